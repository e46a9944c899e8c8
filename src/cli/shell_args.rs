//! `pyprobe completions` and `pyprobe man`: the shell completions and the man pages,
//! generated from the command tree itself so they never fall behind it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory};
use clap_complete::Shell;

use super::Cli;

#[derive(Debug, Args)]
#[command(after_help = "To enable them:\n  \
    bash: pyprobe completions bash > ~/.local/share/bash-completion/completions/pyprobe\n  \
    zsh:  pyprobe completions zsh > ~/.zfunc/_pyprobe   (with fpath+=~/.zfunc before compinit)\n  \
    fish: pyprobe completions fish > ~/.config/fish/completions/pyprobe.fish")]
pub struct CompletionsArgs {
    /// The shell to write completions for.
    #[arg(value_enum)]
    pub shell: Shell,
}

impl CompletionsArgs {
    pub fn run(&self) -> Result<ExitCode> {
        let mut out = std::io::stdout().lock();
        clap_complete::generate(self.shell, &mut Cli::command(), "pyprobe", &mut out);
        out.flush()
            .context("could not write the completions to stdout")?;
        Ok(ExitCode::SUCCESS)
    }
}

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    pyprobe man | man -l -                      read it now\n  \
    pyprobe man --dir ~/.local/share/man/man1   install pyprobe.1 and one page per subcommand")]
pub struct ManArgs {
    /// Write pyprobe.1 and a page per subcommand (pyprobe-record.1, ...) into this
    /// directory, rather than pyprobe.1 to stdout.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

impl ManArgs {
    pub fn run(&self) -> Result<ExitCode> {
        match &self.dir {
            Some(dir) => write_pages(dir)?,
            None => {
                let mut out = std::io::stdout().lock();
                clap_mangen::Man::new(Cli::command())
                    .render(&mut out)
                    .context("could not write the man page to stdout")?;
                out.flush()
                    .context("could not write the man page to stdout")?;
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// Writes the top page and one per subcommand, each named as `man` looks it up.
fn write_pages(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("could not create the directory {}", dir.display()))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .with_context(|| format!("could not write the man pages into {}", dir.display()))
}
