//! The line editor's helper: tab completion and multi-line input for the shell.
//!
//! Completion offers SQL keywords, function names, the session's tables and their columns,
//! meta-commands, output formats after `\format`, and file names after `\i`. A line is
//! complete when it is a meta-command or its last statement ends with `;`.

use datafusion::sql::sqlparser::keywords::ALL_KEYWORDS;

/// Words of Fulmen's own statements (`CACHE TABLE`, `SHOW DEVICES`, `CREATE SINK`, …)
/// that SQL's keywords may lack.
const FULMEN_WORDS: &[&str] = &[
    "CACHE", "UNCACHE", "REFRESH", "DEVICES", "SINK", "SINKS", "STREAMS",
];
use rustyline::completion::{Completer, FilenameCompleter, Pair};
use rustyline::validate::{ValidationContext, ValidationResult, Validator};
use rustyline::{Context, Helper, Highlighter, Hinter};

use crate::command::META_COMMANDS;
use crate::format::FORMAT_NAMES;
use crate::split::split;

/// Names the shell can complete, refreshed after every statement.
#[derive(Helper, Hinter, Highlighter)]
pub struct ShellHelper {
    /// Table names, column names and function names of the session.
    names: Vec<String>,
    files: FilenameCompleter,
}

impl Default for ShellHelper {
    fn default() -> Self {
        Self::new()
    }
}

impl ShellHelper {
    /// A helper that knows only SQL keywords until [`ShellHelper::set_names`] is called.
    pub fn new() -> Self {
        Self {
            names: Vec::new(),
            files: FilenameCompleter::new(),
        }
    }

    /// Replaces the session names offered for completion.
    pub fn set_names(&mut self, mut names: Vec<String>) {
        names.sort();
        names.dedup();
        self.names = names;
    }

    /// The completions for the word that ends at `pos` in `line`.
    pub fn candidates(&self, line: &str, pos: usize) -> (usize, Vec<String>) {
        let before = &line[..pos];
        let start = before
            .char_indices()
            .rev()
            .find(|(_, c)| !(c.is_alphanumeric() || *c == '_' || *c == '\\'))
            .map_or(0, |(i, c)| i + c.len_utf8());
        let word = &before[start..];
        let trimmed = before.trim_start();
        if let Some(meta) = word.strip_prefix('\\')
            && trimmed.len() == word.len()
        {
            let found = META_COMMANDS
                .iter()
                .filter(|(name, _)| name.starts_with(meta))
                .map(|(name, _)| format!("\\{name}"))
                .collect();
            return (start, found);
        }
        if trimmed.starts_with("\\format") {
            let found = FORMAT_NAMES
                .iter()
                .filter(|f| f.starts_with(word))
                .map(|f| f.to_string())
                .collect();
            return (start, found);
        }
        if word.is_empty() {
            return (start, Vec::new());
        }
        let lower = word.to_ascii_lowercase();
        let mut found: Vec<String> = self
            .names
            .iter()
            .filter(|n| n.to_ascii_lowercase().starts_with(&lower))
            .cloned()
            .collect();
        let keep_lower = word.chars().all(|c| !c.is_ascii_uppercase());
        found.extend(
            ALL_KEYWORDS
                .iter()
                .chain(FULMEN_WORDS)
                .filter(|k| k.to_ascii_lowercase().starts_with(&lower))
                .map(|k| {
                    if keep_lower {
                        k.to_ascii_lowercase()
                    } else {
                        k.to_string()
                    }
                }),
        );
        let mut seen = std::collections::HashSet::new();
        found.retain(|w| seen.insert(w.clone()));
        (start, found)
    }
}

impl Completer for ShellHelper {
    type Candidate = Pair;

    fn complete(
        &self,
        line: &str,
        pos: usize,
        ctx: &Context<'_>,
    ) -> rustyline::Result<(usize, Vec<Pair>)> {
        if line.trim_start().starts_with("\\i ") {
            return self.files.complete(line, pos, ctx);
        }
        let (start, found) = self.candidates(line, pos);
        let pairs = found
            .into_iter()
            .map(|c| Pair {
                display: c.clone(),
                replacement: c,
            })
            .collect();
        Ok((start, pairs))
    }
}

impl Validator for ShellHelper {
    fn validate(&self, ctx: &mut ValidationContext<'_>) -> rustyline::Result<ValidationResult> {
        Ok(if is_complete(ctx.input()) {
            ValidationResult::Valid(None)
        } else {
            ValidationResult::Incomplete
        })
    }
}

/// Whether the shell should run `input` now, or wait for more lines.
pub fn is_complete(input: &str) -> bool {
    let trimmed = input.trim();
    trimmed.is_empty() || trimmed.starts_with('\\') || split(input).rest.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_tables_columns_keywords_and_meta_commands() {
        let mut h = ShellHelper::new();
        h.set_names(vec![
            "lineitem".into(),
            "l_orderkey".into(),
            "orders".into(),
        ]);
        let (start, found) = h.candidates("SELECT l_or", 11);
        assert_eq!(start, 7);
        assert_eq!(found, vec!["l_orderkey".to_string()]);
        let (_, found) = h.candidates("sel", 3);
        assert!(found.contains(&"select".to_string()), "{found:?}");
        let (_, found) = h.candidates("SEL", 3);
        assert!(found.contains(&"SELECT".to_string()), "{found:?}");
        let (_, found) = h.candidates("SELECT * FROM lin", 17);
        assert!(found.contains(&"lineitem".to_string()), "{found:?}");
        let (start, found) = h.candidates("\\ti", 3);
        assert_eq!((start, found), (0, vec!["\\timing".to_string()]));
        let (_, found) = h.candidates("SHOW DEV", 8);
        assert_eq!(found, vec!["DEVICES".to_string()]);
        let (_, found) = h.candidates("unca", 4);
        assert_eq!(found, vec!["uncache".to_string()]);
        let (_, found) = h.candidates("\\format c", 9);
        assert_eq!(found, vec!["csv".to_string()]);
    }

    #[test]
    fn multi_line_statements_wait_for_the_semicolon() {
        assert!(!is_complete("SELECT 1"));
        assert!(!is_complete("SELECT ';'"));
        assert!(is_complete("SELECT 1;"));
        assert!(is_complete("SELECT 1\n  + 2;"));
        assert!(is_complete("\\dt"));
        assert!(is_complete("   "));
        assert!(is_complete("-- a comment"));
    }
}
