//! `kvtier-l3`: the L3 store as a server process (see `kvtier_l3::cli`).

fn main() -> std::process::ExitCode {
    kvtier_l3::cli::main_with_args(std::env::args_os())
}
