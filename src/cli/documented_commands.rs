//! Every `pyprobe` command the README and the user documentation show is one that
//! today's command line accepts: a renamed option fails here, not in a user's shell.

use std::path::Path;

use clap::Parser;

use super::Cli;

/// The documents whose shell examples are checked, from the package root.
const DOCUMENTS: [&str; 3] = ["README.md", "docs/usage.md", "docs/faq.md"];

/// Placeholders the documents use where a value must be given, and a value of the
/// type the option takes.
const PLACEHOLDERS: [(&str, &str); 2] = [("HOSTPID", "4242"), ("PID", "4242")];

/// The `pyprobe ...` lines of the shell code blocks of `text`, with the line number
/// each starts on. A trailing comment is dropped; a line ending in `\` goes on.
fn shell_commands(text: &str) -> Vec<(usize, String)> {
    let mut commands = Vec::new();
    let mut in_shell = false;
    let mut pending: Option<(usize, String)> = None;
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if let Some(fence) = trimmed.strip_prefix("```") {
            in_shell = !in_shell && matches!(fence, "sh" | "bash" | "shell" | "console");
            continue;
        }
        if !in_shell {
            continue;
        }
        let code = strip_comment(trimmed);
        let (number, mut command) = match pending.take() {
            Some((number, start)) => (number, start + " " + code),
            None if code.starts_with("pyprobe ") => (index + 1, code.to_string()),
            None => continue,
        };
        if command.ends_with('\\') {
            command.pop();
            pending = Some((number, command));
        } else {
            commands.push((number, command));
        }
    }
    commands
}

/// The command before an unquoted `#` that starts a word.
fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    let mut previous = ' ';
    for (at, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            (None, '#') if previous.is_whitespace() => return line[..at].trim_end(),
            _ => {}
        }
        previous = c;
    }
    line
}

/// The words of the pyprobe command itself, before a redirection or the next command
/// of a pipeline or list.
fn pyprobe_words(words: &[String]) -> &[String] {
    let end = words
        .iter()
        .position(|w| {
            matches!(w.as_str(), "|" | "||" | "&&" | ";" | "&")
                || w.starts_with(['>', '<'])
                || w.starts_with("2>")
        })
        .unwrap_or(words.len());
    &words[..end]
}

fn with_values(command: &str) -> String {
    PLACEHOLDERS
        .iter()
        .fold(command.to_string(), |text, (name, value)| {
            text.replace(name, value)
        })
}

#[test]
fn every_documented_command_parses() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    let mut failures = Vec::new();
    for document in DOCUMENTS {
        let text = std::fs::read_to_string(root.join(document))
            .unwrap_or_else(|e| panic!("could not read {document}: {e}"));
        for (line, command) in shell_commands(&text) {
            let words = shlex::split(&with_values(&command))
                .unwrap_or_else(|| panic!("{document}:{line}: unbalanced quotes: {command}"));
            let words = pyprobe_words(&words);
            if let Err(e) = Cli::try_parse_from(words) {
                failures.push(format!("{document}:{line}: {command}\n{e}"));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        checked >= 20,
        "only {checked} commands found in the documents"
    );
}

#[test]
fn commands_are_found_in_shell_blocks_only_and_lose_their_comments() {
    let text = "pyprobe record outside\n```sh\npyprobe record -p PID -d 30   # thirty s\n\
        echo pyprobe\npyprobe flame a \\\n  --format chrome\n```\n```yaml\npyprobe: x\n```\n";
    assert_eq!(
        shell_commands(text),
        vec![
            (3, "pyprobe record -p PID -d 30".to_string()),
            (5, "pyprobe flame a  --format chrome".to_string()),
        ]
    );
}

#[test]
fn redirections_and_pipelines_end_the_command() {
    let words = shlex::split("pyprobe man --dir d > out 2>&1 | less").unwrap();
    assert_eq!(pyprobe_words(&words), ["pyprobe", "man", "--dir", "d"]);
}

#[test]
fn a_misspelt_option_is_caught() {
    let words = shlex::split("pyprobe record --mdoe trace -- python3 app.py").unwrap();
    assert!(Cli::try_parse_from(&words).is_err());
}
