//! `idem check`: the harness pointed at anyone's implementation. It judges
//! the contract, never the spelling: answers are parsed, not compared as
//! idem prints them; statuses and reasons the contract leaves open are read
//! from a profile, or accepted as any stable answer of the right class;
//! and every verdict names the sentence of the contract it rests on.
//!
//! Two targets: a command that speaks the lab's contract ([`engine`]: `CMD
//! --db DB --request REQ [--crash-after-claim]`, `CMD --db DB --purge-before
//! T`), judged on SQLite databases the check builds with its own random
//! accounts, amounts and keys; or an HTTP service ([`url`]), judged by the
//! IETF draft and DESIGN §2; or a service the check starts itself
//! ([`life`]: `--serve`), judged as a URL is and, besides, through a
//! SIGKILL and a restart and a SIGTERM, under load. [`model`] holds the
//! plain model that random days are judged against.
//!
//! A property runs all its steps even after one fails, so a report shows
//! every failure a property found; a property that cannot be decided
//! without guessing the implementation's choices is a SKIP, with why.

mod bodies;
pub mod engine;
pub mod history;
pub mod http;
pub mod lab;
pub mod leak;
pub mod life;
pub mod model;
mod openapi;
mod operations;
mod process;
mod races;
pub mod url;
pub mod walk;

/// Why the check could not carry out a step, or set itself up: its own
/// trouble, as opposed to a failure of the implementation (a verdict).
#[derive(Debug)]
pub enum CheckError {
    /// Running or reaching the implementation, or the check's own files:
    /// what it was doing, and the system's error.
    Io { doing: String, source: std::io::Error },
    /// The check's own bank, a SQLite file it builds and reads.
    Bank(rusqlite::Error),
    /// Anything else, in the check's words (a command line it cannot
    /// split, an address it cannot reach, an answer it cannot read).
    Step(String),
}

impl CheckError {
    /// An `Io` error's constructor for `map_err`, saying what was being done.
    pub fn io(doing: impl Into<String>) -> impl FnOnce(std::io::Error) -> CheckError {
        let doing = doing.into();
        move |source| CheckError::Io { doing, source }
    }
}

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckError::Io { doing, source } => write!(f, "{doing}: {source}"),
            CheckError::Bank(e) => write!(f, "the check's bank: {e}"),
            CheckError::Step(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for CheckError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CheckError::Io { source, .. } => Some(source),
            CheckError::Bank(e) => Some(e),
            CheckError::Step(_) => None,
        }
    }
}

impl From<String> for CheckError {
    fn from(why: String) -> Self {
        CheckError::Step(why)
    }
}

impl From<&str> for CheckError {
    fn from(why: &str) -> Self {
        CheckError::Step(why.to_owned())
    }
}

impl From<rusqlite::Error> for CheckError {
    fn from(e: rusqlite::Error) -> Self {
        CheckError::Bank(e)
    }
}

/// One property's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It holds; with what it allowed that a reader must know.
    Pass(Vec<String>),
    /// The steps that show the failures, each failure marked `=> FAIL`.
    Fail(Vec<String>),
    /// Why the property could not be decided.
    Skip(String),
}

impl Verdict {
    pub fn failed(&self) -> bool {
        matches!(self, Verdict::Fail(_))
    }
}

/// A property: its name, the sentence of the contract it rests on, and
/// how to judge it.
pub struct Property<T: ?Sized> {
    pub name: &'static str,
    pub contract: &'static str,
    pub judge: fn(&T, &mut Trace) -> Result<(), CheckError>,
}

/// The steps a property took, and the failures it found among them.
#[derive(Default)]
pub struct Trace {
    steps: Vec<String>,
    failures: usize,
    skipped: Option<String>,
    /// What a PASS says too: what it allowed, that a reader must know.
    notes: Vec<String>,
}

impl Trace {
    pub fn step(&mut self, what: impl Into<String>) {
        self.steps.push(what.into());
    }

    /// A step that a PASS shows as well (a choice the profile declared,
    /// and what it let through).
    pub fn note(&mut self, what: impl Into<String>) {
        let what = what.into();
        self.notes.push(what.clone());
        self.steps.push(what);
    }

    /// Nothing failed or skipped so far.
    pub fn passing(&self) -> bool {
        self.failures == 0 && self.skipped.is_none()
    }

    /// Records a failure unless `ok`; the property goes on.
    pub fn expect(&mut self, ok: bool, why: impl FnOnce() -> String) -> bool {
        if !ok {
            self.failures += 1;
            self.steps.push(format!("=> FAIL: {}", why()));
        }
        ok
    }

    /// The property cannot be decided (unless something failed already).
    pub fn skip(&mut self, why: impl Into<String>) {
        self.skipped.get_or_insert(why.into());
    }

    fn verdict(self, error: Result<(), CheckError>) -> Verdict {
        let mut steps = self.steps;
        match (error, self.failures, self.skipped) {
            (Err(e), _, _) => {
                steps.push(format!("=> FAIL: {e}"));
                Verdict::Fail(steps)
            }
            (Ok(()), 0, Some(why)) => Verdict::Skip(why),
            (Ok(()), 0, None) => Verdict::Pass(self.notes),
            (Ok(()), _, _) => Verdict::Fail(steps),
        }
    }
}

/// Judges the properties of `table` on `target`: every one, or those
/// whose name contains one of `only` (to rerun a failure alone).
pub fn judge<'a, T: ?Sized>(
    table: impl IntoIterator<Item = &'a Property<T>>,
    target: &T,
    only: &[String],
) -> Vec<(&'a Property<T>, Verdict)> {
    table
        .into_iter()
        .filter(|p| only.is_empty() || only.iter().any(|o| p.name.contains(o.as_str())))
        .map(|p| {
            history::property(p.name);
            let mut trace = Trace::default();
            let error = (p.judge)(target, &mut trace);
            (p, trace.verdict(error))
        })
        .collect()
}

/// The report, one line per property (PASS, FAIL, SKIP), and under each
/// failure its contract sentence and the steps that show it; then the tally.
pub fn report<T: ?Sized>(results: &[(&Property<T>, Verdict)]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for (property, verdict) in results {
        // writing to a String cannot fail
        let _ = match verdict {
            Verdict::Pass(notes) => {
                let _ = writeln!(out, "PASS  {}", property.name);
                notes.iter().try_for_each(|note| writeln!(out, "        note: {note}"))
            }
            Verdict::Skip(why) => writeln!(out, "SKIP  {} ({why})", property.name),
            Verdict::Fail(steps) => {
                let _ = writeln!(out, "FAIL  {}", property.name);
                let _ = writeln!(out, "        contract: {}", property.contract);
                steps.iter().try_for_each(|step| writeln!(out, "        {step}"))
            }
        };
    }
    let failed = results.iter().filter(|(_, v)| v.failed()).count();
    let skipped = results.iter().filter(|(_, v)| matches!(v, Verdict::Skip(_))).count();
    let _ = writeln!(out, "{} passed, {failed} failed, {skipped} skipped", results.len() - failed - skipped);
    out
}

/// Whether an answer meets a choice the contract leaves open: the side the
/// profile declared (`Some(true)`: `yes`; `Some(false)`: `no`), or either.
pub(crate) fn as_declared(declared: Option<bool>, yes: bool, no: bool) -> bool {
    declared.map_or(yes || no, |d| if d { yes } else { no })
}

/// Judges a refusal's retry by whether refusals are stored (`declared`, or
/// either when `None`): `stored`, it replayed the refusal; `evaluated`, it
/// got the same refusal again, evaluated anew.
pub(crate) fn expect_refused_again(
    t: &mut Trace,
    declared: Option<bool>,
    stored: bool,
    evaluated: bool,
    what: &str,
) {
    t.expect(as_declared(declared, stored, evaluated), || match declared {
        Some(true) => format!("{what}: the refusal was not stored and replayed as it was"),
        Some(false) => format!("{what}: the profile says refusals are evaluated again, not replayed"),
        None => format!("{what}: a retry was neither the stored refusal nor the same refusal again"),
    });
}

/// `text` flattened to one line of at most 140 characters, for a step.
pub fn short(text: &str) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    flat.chars().take(140).collect()
}
