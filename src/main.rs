//! The `pyprobe` binary: parse the command line and dispatch.

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Command, ReportAction};
use pyprobe::session;

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Probes(args) => session::probes::run(&args.request()),
        Command::Record(args) => session::record::run(&args.request()),
        Command::Flame(args) => args
            .request()
            .and_then(|request| session::views::flame(&request)),
        Command::Report(args) => args.action().and_then(|action| match action {
            ReportAction::Print(request) => session::report::run(&request),
            ReportAction::Page(request) => session::views::flame(&request),
        }),
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
