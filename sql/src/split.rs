//! Splitting SQL text into statements.
//!
//! Statements end with `;` outside of quotes and comments. A line whose first non-blank
//! character is `\` is a meta-command and ends at the end of its line. Splitting happens
//! before parsing so that one bad statement does not hide the good ones before it.

/// One piece of a script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// A SQL statement, without its terminating `;`.
    Sql(String),
    /// A meta-command line such as `\d lineitem`, without the leading `\`.
    Meta(String),
}

/// The result of splitting: the complete pieces, and any text after the last one that is
/// not yet a complete statement (no terminating `;`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Split {
    /// Complete statements and meta-commands, in order.
    pub pieces: Vec<Piece>,
    /// Text after the last complete piece, trimmed; empty when there is none.
    pub rest: String,
    /// Bytes of the text the complete pieces took (the rest starts there), so that text
    /// arriving line by line can be split again from there as it grows.
    pub consumed: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Normal,
    SingleQuote,
    DoubleQuote,
    LineComment,
    BlockComment(usize),
    Dollar,
}

/// Splits `text` into statements and meta-commands.
pub fn split(text: &str) -> Split {
    let mut out = Split::default();
    let mut current = String::new();
    let mut state = State::Normal;
    let mut dollar_tag = String::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    let mut consumed = 0; // in chars
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match state {
            State::Normal => {
                if c == '\\' && current.trim().is_empty() {
                    // A meta-command: the rest of the line.
                    let end = chars[i..]
                        .iter()
                        .position(|&c| c == '\n')
                        .map_or(chars.len(), |p| i + p);
                    let line: String = chars[i + 1..end].iter().collect();
                    out.pieces.push(Piece::Meta(
                        line.trim().trim_end_matches(';').trim().to_string(),
                    ));
                    current.clear();
                    i = end + 1;
                    consumed = i.min(chars.len());
                    continue;
                }
                match c {
                    ';' => {
                        let stmt = current.trim();
                        if !is_blank_sql(stmt) {
                            out.pieces.push(Piece::Sql(stmt.to_string()));
                        }
                        current.clear();
                        i += 1;
                        consumed = i;
                        continue;
                    }
                    '\'' => state = State::SingleQuote,
                    '"' => state = State::DoubleQuote,
                    '-' if next == Some('-') => state = State::LineComment,
                    '/' if next == Some('*') => {
                        state = State::BlockComment(1);
                        current.push_str("/*");
                        i += 2;
                        continue;
                    }
                    '$' => {
                        // $$ or $tag$ opens a dollar-quoted string.
                        let tag_end = chars[i + 1..]
                            .iter()
                            .position(|c| !(c.is_alphanumeric() || *c == '_'))
                            .map(|p| i + 1 + p);
                        if let Some(end) = tag_end
                            && chars[end] == '$'
                            && !chars[i + 1..end]
                                .first()
                                .is_some_and(|c| c.is_ascii_digit())
                        {
                            dollar_tag = chars[i..=end].iter().collect();
                            current.push_str(&dollar_tag);
                            state = State::Dollar;
                            i = end + 1;
                            continue;
                        }
                    }
                    _ => {}
                }
            }
            State::SingleQuote => {
                if c == '\'' {
                    state = State::Normal;
                }
            }
            State::DoubleQuote => {
                if c == '"' {
                    state = State::Normal;
                }
            }
            State::LineComment => {
                if c == '\n' {
                    state = State::Normal;
                }
            }
            State::BlockComment(depth) => {
                if c == '*' && next == Some('/') {
                    state = if depth == 1 {
                        State::Normal
                    } else {
                        State::BlockComment(depth - 1)
                    };
                    current.push_str("*/");
                    i += 2;
                    continue;
                } else if c == '/' && next == Some('*') {
                    state = State::BlockComment(depth + 1);
                    current.push_str("/*");
                    i += 2;
                    continue;
                }
            }
            State::Dollar => {
                let tag: Vec<char> = dollar_tag.chars().collect();
                if chars[i..].starts_with(&tag) {
                    current.push_str(&dollar_tag);
                    i += tag.len();
                    state = State::Normal;
                    continue;
                }
            }
        }
        current.push(c);
        i += 1;
    }
    let rest = current.trim();
    if !is_blank_sql(rest) {
        out.rest = rest.to_string();
    }
    out.consumed = text
        .char_indices()
        .nth(consumed)
        .map_or(text.len(), |(byte, _)| byte);
    out
}

/// Whether `text` holds nothing but whitespace and comments.
fn is_blank_sql(text: &str) -> bool {
    let mut rest = text.trim_start();
    loop {
        if rest.is_empty() {
            return true;
        }
        if let Some(after) = rest.strip_prefix("--") {
            rest = after.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else if let Some(after) = rest.strip_prefix("/*") {
            match after.find("*/") {
                Some(p) => rest = after[p + 2..].trim_start(),
                None => return true,
            }
        } else {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sql(s: &str) -> Piece {
        Piece::Sql(s.to_string())
    }

    #[test]
    fn splits_on_semicolons_outside_quotes_and_comments() {
        let s = split("SELECT 1; SELECT ';' AS \"a;b\" -- c;\n FROM t; /* x; */ SELECT 2;");
        assert_eq!(
            s.pieces,
            vec![
                sql("SELECT 1"),
                sql("SELECT ';' AS \"a;b\" -- c;\n FROM t"),
                sql("/* x; */ SELECT 2"),
            ]
        );
        assert_eq!(s.rest, "");
    }

    #[test]
    fn text_split_as_it_arrives_gives_the_same_pieces() {
        let text = "SELECT 'a;\n  b' AS x;\n\\d t\nSELECT 2\n  , 3; SELECT 'é;";
        let mut pending = String::new();
        let mut pieces = Vec::new();
        for line in text.split_inclusive('\n') {
            pending.push_str(line);
            let s = split(&pending);
            pieces.extend(s.pieces);
            pending.drain(..s.consumed);
        }
        let whole = split(text);
        assert_eq!(pieces, whole.pieces);
        assert_eq!(split(&pending).rest, whole.rest);
        assert_eq!(&text[whole.consumed..], " SELECT 'é;");
    }

    #[test]
    fn keeps_the_unfinished_tail_and_skips_empty_statements() {
        let s = split(";; SELECT 1;\nSELECT\n  2");
        assert_eq!(s.pieces, vec![sql("SELECT 1")]);
        assert_eq!(s.rest, "SELECT\n  2");
        assert_eq!(split("-- only a comment\n").rest, "");
        assert_eq!(split("SELECT 'unterminated;").rest, "SELECT 'unterminated;");
    }

    #[test]
    fn meta_commands_take_their_line() {
        let s = split("\\d lineitem\nSELECT 1;\n  \\format csv;\n\\q");
        assert_eq!(
            s.pieces,
            vec![
                Piece::Meta("d lineitem".into()),
                sql("SELECT 1"),
                Piece::Meta("format csv".into()),
                Piece::Meta("q".into()),
            ]
        );
    }

    #[test]
    fn dollar_quotes_and_nested_comments() {
        let s = split("SELECT $$a;b$$; SELECT $x$;$x$; /* a /* b; */ c; */ SELECT 3;");
        assert_eq!(
            s.pieces,
            vec![
                sql("SELECT $$a;b$$"),
                sql("SELECT $x$;$x$"),
                sql("/* a /* b; */ c; */ SELECT 3")
            ]
        );
    }
}
