//! The integration tests, in one binary: pyprobe run against live processes (the
//! test interpreters and the C SDT fixtures), its library driven on them, and the
//! views of recordings built in-process.

mod support;

mod async_tasks;
mod bad_input;
mod budget;
mod dump_locals;
mod engine_c_fixture;
mod escaping;
mod faults;
mod forged;
mod honest;
mod hook;
mod hook_forks;
mod hook_reattach;
mod hostile_target;
mod html_report;
mod lines;
mod many_threads;
mod native;
mod nothing_lost;
mod outputs;
mod pools;
mod pprof;
mod probes;
mod pstats;
mod qualnames;
mod record;
mod report_schema;
mod ring;
mod ring_reattach;
mod ring_stacks;
mod ring_takeover;
mod safety;
mod sample;
mod sample_accuracy;
mod sdt_decode;
mod shell;
mod sigkill;
mod stopped;
mod stored_views;
mod subinterpreters;
mod thread_state;
mod top_all;
mod top_live;
mod trace_truth;
mod unprivileged;
mod views;
mod walker;
mod wheel;
