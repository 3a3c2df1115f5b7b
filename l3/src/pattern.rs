//! Key patterns for `RemoveByRegex`: Mooncake's master compiles the pattern with
//! `std::regex` (ECMAScript grammar) and removes every key in which it is *found*
//! (`regex_search`, not a whole-key match); a pattern it cannot compile is -600.
//!
//! Why the `regex` crate and not a hand-written matcher: it guarantees linear-time matching
//! (a key pattern comes from a client, and one slow pattern would hold the master's lock),
//! bounds the compiled size, and rejects bad syntax with an error instead of panicking.
//! Its grammar is close to ECMAScript's for what key filters use (classes, anchors,
//! alternation, repetition, `\d \w \s \b`). Where they differ we follow Mooncake when it
//! refuses: inline flags and named groups (`(?i)`, `(?P<n>..)`, `(?<n>..)`) are not
//! ECMAScript and are -600, as Mooncake answers. Lookahead (`(?=..)`, `(?!..)`) and
//! backreferences (`\1`), which Mooncake accepts, need backtracking and are -600 here
//! (documented in docs/python.md).
//!
//! Mooncake's `std::regex` works on the key's bytes as `char`s in the "C" locale: `\d`, `\w`,
//! `\s` and `\b` are ASCII classes and `.` is one byte other than `\n` and `\r`. So the
//! pattern is compiled without Unicode classes over the key's bytes (`regex::bytes`, Unicode
//! mode off, CRLF mode for `.`): with Unicode classes `^page-\d$` also removed "page-٣"
//! and `^a.b$` "aéb", keys Mooncake keeps. A non-ASCII literal in a pattern still matches
//! its UTF-8 bytes, as in Mooncake.

use regex::bytes::{Regex, RegexBuilder};

use crate::error::{L3Error, L3Result};

/// Longest pattern accepted, in bytes (a key is at most a few hundred bytes; this only
/// bounds the work a client can ask of the master).
pub const MAX_PATTERN_BYTES: usize = 4096;

/// Compiled size limit of a pattern (the `regex` crate's own guard against blow-up).
const MAX_COMPILED_BYTES: usize = 1 << 20;

/// A compiled key pattern; only [`KeyPattern::new`] builds one, so a pattern that reaches
/// the master is valid.
#[derive(Debug, Clone)]
pub struct KeyPattern(Regex);

impl KeyPattern {
    /// Compiles a Mooncake (ECMAScript) key pattern; -600 if it is invalid or unsupported.
    pub fn new(pattern: &str) -> L3Result<Self> {
        if pattern.len() > MAX_PATTERN_BYTES {
            return Err(L3Error::InvalidParams(format!(
                "regex pattern is {} bytes, more than {MAX_PATTERN_BYTES}",
                pattern.len()
            )));
        }
        if let Some(at) = non_ecmascript_group(pattern) {
            return Err(L3Error::InvalidParams(format!(
                "invalid regex pattern: `(?` at byte {at} (inline flags and named groups are not ECMAScript)"
            )));
        }
        RegexBuilder::new(&bytewise(pattern))
            .unicode(false)
            .crlf(true)
            .size_limit(MAX_COMPILED_BYTES)
            .dfa_size_limit(MAX_COMPILED_BYTES)
            .build()
            .map(KeyPattern)
            // (the message names the pattern as given: `e` shows it with bytes escaped)
            .map_err(|e| L3Error::InvalidParams(format!("invalid regex pattern {pattern:?}: {e}")))
    }

    /// Whether the pattern occurs anywhere in `key` (`std::regex_search`).
    pub fn is_found_in(&self, key: &str) -> bool {
        self.0.is_match(key.as_bytes())
    }
}

/// `pattern` with each non-ASCII character written as its UTF-8 bytes (`\xHH` each), as
/// `std::regex` reads it: one `char` per byte, in a class too (`[é]` is a class of two
/// bytes, which Unicode-off syntax would refuse as a character), and `é+` repeats its last
/// byte. An escaped non-ASCII character is the character itself (an identity escape).
fn bytewise(pattern: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(pattern.len());
    let mut escaped = false;
    for c in pattern.chars() {
        if c.is_ascii() {
            out.push(c);
            escaped = c == '\\' && !escaped;
            continue;
        }
        if escaped {
            out.pop(); // the backslash: `\é` is `é`
        }
        let mut buf = [0u8; 4];
        for b in c.encode_utf8(&mut buf).bytes() {
            let _ = write!(out, "\\x{b:02X}");
        }
        escaped = false;
    }
    out
}

/// Byte offset of a `(?` group other than `(?:` outside a character class, if any.
/// (`(?=`/`(?!` are ECMAScript but the `regex` crate refuses them itself.)
fn non_ecmascript_group(p: &str) -> Option<usize> {
    let b = p.as_bytes();
    let (mut i, mut in_class) = (0, false);
    while i < b.len() {
        match b[i] {
            b'\\' => i += 1,
            b'[' if !in_class => in_class = true,
            b']' if in_class => in_class = false,
            b'(' if !in_class
                && b.get(i + 1) == Some(&b'?')
                && !matches!(b.get(i + 2), Some(b':' | b'=' | b'!')) =>
            {
                return Some(i);
            }
            _ => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_not_whole_match() {
        let p = KeyPattern::new("rx-a").unwrap();
        assert!(p.is_found_in("rx-a1") && p.is_found_in("x-rx-a3") && !p.is_found_in("RX-A4"));
        assert!(KeyPattern::new("").unwrap().is_found_in("anything"));
        let anchored = KeyPattern::new(r"^rx-\d+$").unwrap();
        assert!(anchored.is_found_in("rx-12") && !anchored.is_found_in("rx-12x"));
    }

    #[test]
    fn what_mooncake_refuses_is_invalid_params() {
        // Each of these is -600 from Mooncake 0.3.x's master (measured side by side).
        for bad in ["(", "[a-", "a{2,1}", "*a", "(?<=a)b", "(?i)rx", "(?P<n>a)"] {
            let e = KeyPattern::new(bad).unwrap_err();
            assert_eq!(e.code_i32(), -600, "{bad}");
        }
        assert!(KeyPattern::new(&"a".repeat(MAX_PATTERN_BYTES + 1)).is_err());
    }

    #[test]
    fn classes_are_ascii_and_dot_is_one_byte() {
        let found = |p: &str, k: &str| KeyPattern::new(p).unwrap().is_found_in(k);
        assert!(found(r"^p\d$", "p7") && !found(r"^p\d$", "p\u{663}"));
        assert!(!found(r"^a.b$", "a\u{e9}b") && found(r"^a..b$", "a\u{e9}b"));
        assert!(!found(r"^a.b$", "a\rb") && !found(r"^a.b$", "a\nb"));
        assert!(found("^caf\u{e9}$", "caf\u{e9}") && found(r"[^x]", "\u{e9}"));
        // a non-ASCII character is its bytes, in a class too (std::regex over chars)
        assert!(found("^[\u{e9}]{2}$", "\u{e9}") && !found("^[^\u{e9}]+$", "\u{e9}"));
        assert!(found("^\u{e9}+$", "\u{e9}") && !found("^\u{e9}+$", "\u{e9}\u{e9}"));
        assert!(found("^\\\u{e9}$", "\u{e9}") && found("^\\\\\u{e9}$", "\\\u{e9}"));
    }

    #[test]
    fn escaped_and_class_parens_are_not_groups() {
        for ok in [r"\(?x", "[(?]x", "(?:ab)+", r"[\]](?:x)"] {
            assert!(KeyPattern::new(ok).is_ok(), "{ok}");
        }
        assert!(KeyPattern::new(r"[\]](?i)x").is_err());
    }
}
