//! `idem_api`: the lab's engine contract (see `idem::api`).

fn main() -> std::process::ExitCode {
    idem::api::main(std::env::args_os())
}
