//! `chaos_timeline.svg`: the day as a picture. Per slice of the day, the
//! attempts that made a transfer, that were answered with a replay, and
//! that failed (5xx, or no answer at all), over time; each fault of the
//! machine room a dashed line with its name; and, on a replicated
//! database, a band under the axis shaded by which node was the primary
//! (sampled). A person sees where writes stopped, for how long, and where
//! the primary moved.

use super::clients::Intent;
use std::fmt::Write;
use std::time::Instant;

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 310.0;
const LEFT: f64 = 50.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 70.0;
/// How many slices the day is cut into.
const SLICES: usize = 90;

/// The three series, one count per slice.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Series {
    pub made: Vec<u32>,
    pub replayed: Vec<u32>,
    pub failed: Vec<u32>,
    /// A slice's length, in seconds.
    pub slice_s: f64,
}

/// Counts each attempt in the slice it ended in.
pub(super) fn series(intents: &[Intent], started: Instant, ended: Instant) -> Series {
    let day = ended.saturating_duration_since(started).as_secs_f64().max(0.001);
    let slice_s = day / SLICES as f64;
    let mut s = Series { made: vec![0; SLICES], replayed: vec![0; SLICES], failed: vec![0; SLICES], slice_s };
    for t in intents.iter().flat_map(|i| i.tries.iter()) {
        let at = t.ended.saturating_duration_since(started).as_secs_f64();
        let k = ((at / slice_s) as usize).min(SLICES - 1);
        match t.status {
            Some(200..=299) if t.replayed => s.replayed[k] += 1,
            Some(200..=299) => s.made[k] += 1,
            Some(500..=599) | None => s.failed[k] += 1,
            // refusals (4xx) are answers: the database was there
            Some(_) => {}
        }
    }
    s
}

/// The picture: the series per second, the faults `marks` (when, what),
/// and the primary's node as sampled (from when, which; `none`: no node
/// took writes).
pub(super) fn svg(s: &Series, marks: &[(f64, &str)], primaries: &[(f64, String)]) -> String {
    let per_s = |n: u32| f64::from(n) / s.slice_s;
    let top = [&s.made, &s.replayed, &s.failed]
        .iter()
        .flat_map(|v| v.iter().map(|&n| per_s(n)))
        .fold(1.0, f64::max);
    let day = s.slice_s * SLICES as f64;
    let x = |t: f64| LEFT + (WIDTH - LEFT - RIGHT) * (t / day).clamp(0.0, 1.0);
    let y = |v: f64| HEIGHT - BOTTOM - (HEIGHT - TOP - BOTTOM) * v / top;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let _ = writeln!(
        out,
        "<line x1=\"{LEFT}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"black\"/>\
         <line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{0}\" stroke=\"black\"/>",
        HEIGHT - BOTTOM,
        WIDTH - RIGHT
    );
    let _ = writeln!(out, "<text x=\"{LEFT}\" y=\"{}\">0 s</text>", HEIGHT - BOTTOM + 14.0);
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{day:.1} s</text>",
        WIDTH - RIGHT,
        HEIGHT - BOTTOM + 14.0
    );
    let _ = writeln!(out, "<text x=\"4\" y=\"{}\">{top:.0}/s</text>", TOP + 4.0);
    for (at, what) in marks {
        let _ = writeln!(
            out,
            "<line x1=\"{0:.1}\" y1=\"{TOP}\" x2=\"{0:.1}\" y2=\"{1}\" stroke=\"grey\" stroke-dasharray=\"4 3\"/>\
             <text x=\"{2:.1}\" y=\"{3}\" fill=\"grey\">{what}</text>",
            x(*at),
            HEIGHT - BOTTOM,
            x(*at) + 2.0,
            TOP - 6.0
        );
    }
    primary_band(&mut out, primaries, &x, day);
    for (values, colour, name, row) in [
        (&s.made, "#1f77b4", "transfers made /s", 0),
        (&s.replayed, "#2ca02c", "replays /s", 1),
        (&s.failed, "#d62728", "failed or unanswered /s", 2),
    ] {
        let points: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(k, &n)| format!("{:.1},{:.1}", x((k as f64 + 0.5) * s.slice_s), y(per_s(n))))
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/>\
             <text x=\"{}\" y=\"{}\" fill=\"{colour}\">{name}</text>",
            points.join(" "),
            LEFT + 10.0 + 170.0 * f64::from(row),
            HEIGHT - 8.0
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The band of the primary's node: one shade per node, red where none was.
fn primary_band(out: &mut String, primaries: &[(f64, String)], x: &dyn Fn(f64) -> f64, day: f64) {
    const SHADES: [&str; 4] = ["#dbe9f6", "#fde0c5", "#d9f0d3", "#e5d8ee"];
    let y = HEIGHT - BOTTOM + 20.0;
    let mut names: Vec<&str> = primaries.iter().map(|(_, n)| n.as_str()).filter(|n| *n != "none").collect();
    names.sort_unstable();
    names.dedup();
    if !primaries.is_empty() {
        let _ = writeln!(out, "<text x=\"4\" y=\"{:.1}\">primary</text>", y + 11.0);
    }
    for (k, (from, name)) in primaries.iter().enumerate() {
        let shown: String = name.chars().filter(|c| c.is_alphanumeric() || "-_ .:".contains(*c)).collect();
        let to = primaries.get(k + 1).map_or(day, |p| p.0);
        let fill = match names.iter().position(|n| n == name) {
            Some(i) => SHADES[i % SHADES.len()],
            None => "#f4b6b6",
        };
        let _ = write!(
            out,
            "<rect x=\"{:.1}\" y=\"{y}\" width=\"{:.1}\" height=\"16\" fill=\"{fill}\"><title>{shown}</title></rect>",
            x(*from),
            (x(to) - x(*from)).max(0.0)
        );
        // a name where the primary changes
        if k == 0 || primaries[k - 1].1 != *name {
            let _ = write!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"9\">{shown}</text>",
                x(*from) + 2.0,
                y + 11.0
            );
        }
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::super::clients::{Ending, Intent, Kind};
    use crate::client::Try;
    use std::time::{Duration, Instant};

    fn intent(tries: Vec<Try>) -> Intent {
        Intent {
            client: 0,
            kind: Kind::Transfer,
            key: "k".into(),
            src: "a".into(),
            dst: "b".into(),
            amount: 1,
            verdict: Ending::Done,
            attempts: tries.len() as u32,
            millis: 0,
            told: None,
            tries,
        }
    }

    #[test]
    fn attempts_land_in_the_slice_they_ended_in_and_faults_are_drawn() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let t = |ms, status, replayed| Try { endpoint: 0, sent: at(ms), ended: at(ms), status, replayed };
        let intents = [
            intent(vec![t(100, Some(503), false), t(4_500, Some(201), false)]),
            intent(vec![t(4_650, None, false), t(8_950, Some(201), true)]),
            intent(vec![t(5_000, Some(402), false)]),
        ];
        let s = super::series(&intents, start, at(9_000));
        // 9 s in 90 slices of 0.1 s
        assert_eq!((s.made[45], s.replayed[89], s.failed[1], s.failed[46]), (1, 1, 1, 1));
        assert_eq!(
            s.made.iter().sum::<u32>() + s.replayed.iter().sum::<u32>() + s.failed.iter().sum::<u32>(),
            4
        );
        let primaries = [(0.0, "node1".to_owned()), (4.5, "none".into()), (6.0, "node2".into())];
        let svg = super::svg(&s, &[(4.5, "failover")], &primaries);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 3);
        // the mark half way along the axis: 50 + 830 / 2
        assert!(svg.contains("x1=\"465.0\"") && svg.contains(">failover</text>"), "{svg}");
        // the band: node1 from the start to the mark, none, then node2 to the end
        for band in [
            "x=\"50.0\" y=\"260\" width=\"415.0\" height=\"16\" fill=\"#dbe9f6\"><title>node1",
            "x=\"465.0\" y=\"260\" width=\"138.3\" height=\"16\" fill=\"#f4b6b6\"><title>none",
            "width=\"276.7\" height=\"16\" fill=\"#fde0c5\"><title>node2",
        ] {
            assert!(svg.contains(band), "{band} in {svg}");
        }
    }
}
