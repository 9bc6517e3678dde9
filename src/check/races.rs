//! The check's races: sixteen requests on one key released at one instant,
//! and the properties judged on what such races provoke (`Retry-After` on
//! in-flight answers, a retry that prefers to wait).

use super::http::{Http, Target, begun, ended, read_answer};
use super::{CheckError, Trace};
use std::io::Write;
use std::time::Duration;

/// Sixteen requests of the transfer of `amount` on key `k`, each on its own
/// connection, released by their last byte at one instant; their answers.
pub(super) fn release(
    target: &Target,
    k: &str,
    amount: i64,
    more: &[(&str, String)],
) -> Result<Vec<Http>, CheckError> {
    let auth = ("Authorization", format!("Bearer {}", target.tokens[0]));
    let mut headers = vec![auth, ("Idempotency-Key", target.key_header(k))];
    headers.extend(more.iter().cloned());
    let request = target.post_bytes(&headers, &target.transfer(amount));
    let last = &request[request.len() - 1..];
    let mut streams = Vec::new();
    for _ in 0..16 {
        streams.push(begun(target.address, &request, request.len() - 1, Duration::from_secs(30))?);
    }
    std::thread::sleep(Duration::from_millis(50));
    let barrier = std::sync::Barrier::new(streams.len());
    let answers: Vec<Result<Http, CheckError>> = std::thread::scope(|scope| {
        let runs: Vec<_> = streams
            .into_iter()
            .map(|(mut s, op)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let answer =
                        s.write_all(last).map_err(CheckError::io("send")).and_then(|()| read_answer(&mut s));
                    ended(op, &answer);
                    answer
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|_| Err("a thread panicked".into()))).collect()
    });
    answers.into_iter().collect()
}

/// How many races [`retry_after`] runs, at most, to see an in-flight answer.
const RACES: u64 = 8;

/// Races on fresh keys until one provokes in-flight answers (a fast service
/// may answer every racer with the replay); each must carry `Retry-After`.
pub(super) fn retry_after(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let p = &target.profile;
    if !p.in_flight_retry_after {
        t.skip("the profile does not declare in_flight_retry_after (the draft does not ask for it)");
        return Ok(());
    }
    for race in 0..RACES {
        let answers = release(target, &target.key(100 + race), 12, &[])?;
        let in_flight: Vec<&Http> = answers.iter().filter(|a| a.status == p.in_flight_status).collect();
        if in_flight.is_empty() {
            continue;
        }
        let bare = in_flight.iter().filter(|a| a.header("retry-after").is_none()).count();
        t.step(format!(
            "race {}: {} in-flight answers, {bare} without Retry-After",
            race + 1,
            in_flight.len()
        ));
        t.expect(bare == 0, || format!("{bare} in-flight answers without Retry-After"));
        return Ok(());
    }
    t.skip(format!(
        "no in-flight answer ({}) in {RACES} races of 16 requests: Retry-After not judged",
        p.in_flight_status
    ));
    Ok(())
}

/// With `Prefer: wait=10` on every racer, no racer may be answered in
/// flight: each waits for the first's answer and gets it. Races on fresh
/// keys until an answer says it waited (`Preference-Applied: wait`); a
/// service that answered every racer with a replay never had to wait, and
/// the property is then not exercised (a SKIP).
pub(super) fn attach(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let p = &target.profile;
    if !p.prefer_wait {
        t.skip("the profile does not declare prefer_wait (RFC 7240 Prefer: wait; the draft asks 409)");
        return Ok(());
    }
    let wait = [("Prefer", "wait=10".to_owned())];
    for race in 0..RACES {
        let answers = release(target, &target.key(120 + race), 13, &wait)?;
        let in_flight = answers.iter().filter(|a| a.status == p.in_flight_status).count();
        let waited = answers.iter().filter(|a| a.header("preference-applied") == Some("wait")).count();
        let made: Vec<&Http> = answers.iter().filter(|a| target.made(a)).collect();
        t.step(format!(
            "race {}: 16 racers asking to wait -> statuses {:?}, {waited} with Preference-Applied: wait",
            race + 1,
            answers.iter().map(|a| a.status).collect::<Vec<_>>()
        ));
        t.expect(in_flight == 0, || format!("{in_flight} racers that asked to wait were answered in flight"));
        t.expect(made.len() == answers.len() && made.iter().all(|a| a.body == made[0].body), || {
            "the racers were not all answered with the one transfer".into()
        });
        if in_flight > 0 || waited > 0 {
            return Ok(());
        }
    }
    t.skip(format!("no racer had to wait in {RACES} races (every one answered by a replay): not exercised"));
    Ok(())
}
