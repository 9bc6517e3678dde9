//! `idem_api`: the lab's engine contract (see `idem::api`).

#![forbid(unsafe_code)]

#[path = "idem/api_edge.rs"]
mod api_edge;

fn main() -> std::process::ExitCode {
    api_edge::main(std::env::args_os())
}
