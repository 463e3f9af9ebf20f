//! Meta-commands: the backslash commands of the shell (`\d`, `\format`, `\timing`, …).

use crate::format::OutputFormat;

/// Every meta-command with a one-line description, for `\?` and completion.
pub const META_COMMANDS: &[(&str, &str)] = &[
    ("d", "\\d [NAME]      list tables, or describe table NAME"),
    ("dt", "\\dt            list tables"),
    (
        "format",
        "\\format [FMT]  show or set the output format (table, csv, tsv, json, ndjson, markdown)",
    ),
    (
        "timing",
        "\\timing [on|off]  show or set the row count and elapsed time after each statement",
    ),
    (
        "maxrows",
        "\\maxrows [N]   show or set how many rows the table format shows (0: all)",
    ),
    (
        "devices",
        "\\devices       list the session's devices: state, memory, launches, errors",
    ),
    ("i", "\\i FILE        run the statements in FILE"),
    ("?", "\\?             this help"),
    ("q", "\\q             quit (Ctrl-D works too)"),
];

/// A parsed meta-command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaCommand {
    /// `\q`: leave the shell.
    Quit,
    /// `\?`: print the help.
    Help,
    /// `\d` or `\dt`: list tables.
    ListTables,
    /// `\d NAME`: describe one table.
    Describe(String),
    /// `\format`: show (None) or set the output format.
    Format(Option<OutputFormat>),
    /// `\timing`: show (None) or set timing.
    Timing(Option<bool>),
    /// `\maxrows`: show (None) or set the row limit of the table format.
    MaxRows(Option<usize>),
    /// `\i FILE`: run a file.
    Include(String),
    /// `\devices`: list the session's devices (`fulmen_devices()`).
    Devices,
}

impl MetaCommand {
    /// Parses the text after the backslash.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (name, arg) = match text.split_once(char::is_whitespace) {
            Some((n, a)) => (n, Some(a.trim()).filter(|a| !a.is_empty())),
            None => (text, None),
        };
        let no_arg = |cmd: MetaCommand| match arg {
            None => Ok(cmd),
            Some(a) => Err(format!("\\{name} takes no argument, got '{a}'")),
        };
        match name {
            "q" | "quit" => no_arg(Self::Quit),
            "?" | "h" | "help" => no_arg(Self::Help),
            "dt" => no_arg(Self::ListTables),
            "devices" => no_arg(Self::Devices),
            "d" => Ok(arg.map_or(Self::ListTables, |a| Self::Describe(a.to_string()))),
            "format" => Ok(Self::Format(arg.map(str::parse).transpose()?)),
            "timing" => match arg.map(|a| a.to_ascii_lowercase()) {
                None => Ok(Self::Timing(None)),
                Some(a) if a == "on" || a == "true" => Ok(Self::Timing(Some(true))),
                Some(a) if a == "off" || a == "false" => Ok(Self::Timing(Some(false))),
                Some(a) => Err(format!("\\timing takes on or off, got '{a}'")),
            },
            "maxrows" => match arg {
                None => Ok(Self::MaxRows(None)),
                Some(a) => a
                    .parse()
                    .map(|n| Self::MaxRows(Some(n)))
                    .map_err(|_| format!("\\maxrows takes a whole number, got '{a}'")),
            },
            "i" | "include" => match arg {
                Some(file) => Ok(Self::Include(file.to_string())),
                None => Err("\\i needs a file name: \\i FILE".to_string()),
            },
            "" => Err("empty meta-command; \\? lists them".to_string()),
            other => Err(format!("unknown meta-command '\\{other}'; \\? lists them")),
        }
    }
}

/// The text `\?` prints.
pub fn help_text() -> String {
    let mut text = String::from(
        "Statements end with ';' and may span lines. Ctrl-C cancels a running statement,\n\
         Ctrl-D leaves. Meta-commands:\n",
    );
    for (_, line) in META_COMMANDS {
        text.push_str("  ");
        text.push_str(line);
        text.push('\n');
    }
    text.push_str(
        "Load data with CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION 'path' (also CSV, \
         JSON, ARROW;\ns3://, gs://, az://, http(s):// work too), or query a file directly: \
         SELECT * FROM 'data.csv';\n",
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_command() {
        assert_eq!(MetaCommand::parse("q"), Ok(MetaCommand::Quit));
        assert_eq!(MetaCommand::parse("d"), Ok(MetaCommand::ListTables));
        assert_eq!(MetaCommand::parse("devices"), Ok(MetaCommand::Devices));
        assert_eq!(MetaCommand::parse("dt"), Ok(MetaCommand::ListTables));
        assert_eq!(
            MetaCommand::parse("d  lineitem "),
            Ok(MetaCommand::Describe("lineitem".into()))
        );
        assert_eq!(
            MetaCommand::parse("format csv"),
            Ok(MetaCommand::Format(Some(OutputFormat::Csv)))
        );
        assert_eq!(MetaCommand::parse("format"), Ok(MetaCommand::Format(None)));
        assert_eq!(
            MetaCommand::parse("timing off"),
            Ok(MetaCommand::Timing(Some(false)))
        );
        assert_eq!(
            MetaCommand::parse("maxrows 0"),
            Ok(MetaCommand::MaxRows(Some(0)))
        );
        assert_eq!(
            MetaCommand::parse("i a b.sql"),
            Ok(MetaCommand::Include("a b.sql".into()))
        );
    }

    #[test]
    fn bad_commands_say_what_is_wrong() {
        assert!(
            MetaCommand::parse("x")
                .unwrap_err()
                .contains("unknown meta-command '\\x'")
        );
        assert!(
            MetaCommand::parse("format xml")
                .unwrap_err()
                .contains("unknown format 'xml'")
        );
        assert!(
            MetaCommand::parse("timing maybe")
                .unwrap_err()
                .contains("on or off")
        );
        assert!(
            MetaCommand::parse("q now")
                .unwrap_err()
                .contains("takes no argument")
        );
        assert!(
            MetaCommand::parse("i")
                .unwrap_err()
                .contains("needs a file")
        );
    }
}
