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
            force: args.force,
            verbose: args.verbose,
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
            rate: args.rate,
            nonblocking: args.nonblocking,
            max_overhead: args.max_overhead,
            ring: match args.engine {
                cli::Engine::Auto => pyprobe::tracer::RingUse::Auto,
                cli::Engine::Ring => pyprobe::tracer::RingUse::Required,
                cli::Engine::Int3 => pyprobe::tracer::RingUse::Off,
            },
            samples: sample_filter(args.samples),
        }),
        Command::Flame(args) => {
            match pyprobe::analyze::FileFilter::new(&args.include, &args.exclude) {
                Err(e) => Err(anyhow::anyhow!("{e}")),
                Ok(files) => session::views::flame(&session::views::FlameRequest {
                    file: args.file,
                    output: args.output,
                    format: args.format.map(|f| match f {
                        cli::FlameFormat::Svg => session::views::FlameFormat::Svg,
                        cli::FlameFormat::Collapsed => session::views::FlameFormat::Collapsed,
                        cli::FlameFormat::Speedscope => session::views::FlameFormat::Speedscope,
                        cli::FlameFormat::Chrome => session::views::FlameFormat::Chrome,
                    }),
                    title: args.title,
                    full_paths: args.full_paths,
                    by: match args.by {
                        cli::FlameBy::Time => pyprobe::output::flame::By::Time,
                        cli::FlameBy::Calls => pyprobe::output::flame::By::Calls,
                    },
                    force: args.force,
                    samples: sample_filter(args.samples),
                    filter: pyprobe::analyze::SliceFilter {
                        files,
                        min_duration_ns: args.min_duration.unwrap_or(0),
                    },
                }),
            }
        }
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
                samples: sample_filter(args.samples),
            },
            args.format == cli::ReportFormat::Json,
        ),
        Command::Calls(args) => session::views::calls(&session::views::CallsRequest {
            file: args.file,
            start_at: args.start_at,
            thread: args.thread,
            max_depth: args.max_depth,
            json: args.format == cli::TextFormat::Json,
            full_paths: args.full_paths,
        }),
        Command::Top(args) => session::top::top(&session::top::TopRequest {
            pid: args.target.pid,
            command: args.target.command,
            all: args.all,
            from: args.from,
            interval: args.interval,
            limit: args.limit,
            once: args.once,
            samples: sample_filter(args.samples),
        }),
        Command::Dump(args) => session::dump::run(&session::dump::DumpRequest {
            pid: args.pid,
            json: args.format == cli::TextFormat::Json,
        }),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pyprobe: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn sample_filter(args: cli::SampleArgs) -> pyprobe::analyze::SampleFilter {
    pyprobe::analyze::SampleFilter {
        idle: args.idle,
        gil: args.gil,
    }
}
