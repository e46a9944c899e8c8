//! The `pyprobe` binary: parse the command line and dispatch.

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Command};
use pyprobe::session;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Probes(args) => session::probes::run(&session::probes::ProbesRequest {
            pid: args.pid,
            path: args.path,
            provider: args.provider,
            json: args.format == cli::TableFormat::Json,
        }),
        Command::Record(args) => session::record::run(&session::record::RecordRequest {
            pid: args.target.pid,
            command: args.target.command,
            output: args.output,
            duration: args.duration,
            mode: match args.mode {
                cli::Mode::Auto => "auto",
                cli::Mode::Trace => "trace",
                cli::Mode::Sample => "sample",
            }
            .to_owned(),
            probes: args.probes,
            include: args.include,
            exclude: args.exclude,
            start_at: args.start_at,
            subprocesses: args.subprocesses,
        }),
        Command::Flame(_) => not_implemented("flame"),
        Command::Report(args) => session::report::run(
            &args.file,
            &session::report::ReportRequest {
                sort: match args.sort {
                    None => None,
                    Some(cli::SortKey::Inclusive) => {
                        Some(pyprobe::output::report::SortKey::Inclusive)
                    }
                    Some(cli::SortKey::Exclusive) => {
                        Some(pyprobe::output::report::SortKey::Exclusive)
                    }
                    Some(cli::SortKey::Calls) => Some(pyprobe::output::report::SortKey::Calls),
                },
                limit: (args.format == cli::ReportFormat::Table).then_some(args.limit),
                include: args.include,
                exclude: args.exclude,
            },
            args.format == cli::ReportFormat::Json,
        ),
        Command::Calls(_) => not_implemented("calls"),
        Command::Top(_) => not_implemented("top"),
        Command::Dump(_) => not_implemented("dump"),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pyprobe: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn not_implemented(command: &str) -> anyhow::Result<ExitCode> {
    eprintln!("pyprobe: `{command}` is not implemented yet in this version");
    Ok(ExitCode::from(1))
}
