//! The `pyprobe` binary: parse the command line and dispatch.

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Command};
use pyprobe::session;

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Probes(args) => session::probes::run(&args.request()),
        Command::Record(args) => session::record::run(&args.request()),
        Command::Flame(args) => args
            .request()
            .and_then(|request| session::views::flame(&request)),
        Command::Report(args) => session::report::run(&args.request()),
        Command::Calls(args) => session::views::calls(&args.request()),
        Command::Top(args) => session::top::top(&args.request()),
        Command::Dump(args) => session::dump::run(&args.request()),
        Command::Completions(args) => args.run(),
        Command::Man(args) => args.run(),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pyprobe: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
