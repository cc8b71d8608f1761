//! Routing templates: `{aggregate_type}.{event_type}` and friends.
//!
//! A template is parsed once at start (an unknown placeholder is a configuration error) and
//! rendered per message without allocation beyond the output string.

use std::fmt;

/// The fields a template may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholder {
    /// `{aggregate_type}`
    AggregateType,
    /// `{event_type}`
    EventType,
    /// `{aggregate_id}` (empty when the row has none)
    AggregateId,
}

impl Placeholder {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "aggregate_type" => Some(Self::AggregateType),
            "event_type" => Some(Self::EventType),
            "aggregate_id" => Some(Self::AggregateId),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Field(Placeholder),
}

/// A parsed routing template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

/// Why a template was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// `{name}` is not one of the known placeholders.
    #[error(
        "unknown placeholder {{{0}}} (known: {{aggregate_type}}, {{event_type}}, {{aggregate_id}})"
    )]
    UnknownPlaceholder(String),
    /// A `{` without its `}`.
    #[error("unclosed '{{' at byte {0}")]
    Unclosed(usize),
    /// A `}` without its `{`.
    #[error("unmatched '}}' at byte {0}")]
    Unmatched(usize),
    /// The template renders to nothing.
    #[error("template is empty")]
    Empty,
}

/// The values a template is rendered with.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fields<'a> {
    /// The row's `aggregate_type`.
    pub aggregate_type: &'a str,
    /// The row's `event_type`.
    pub event_type: &'a str,
    /// The row's `aggregate_id`, if any.
    pub aggregate_id: Option<&'a str>,
}

impl Template {
    /// `{aggregate_type}`.
    pub fn aggregate_type() -> Self {
        Self {
            source: "{aggregate_type}".to_owned(),
            parts: vec![Part::Field(Placeholder::AggregateType)],
        }
    }

    /// Parses `source`; `{{` and `}}` are not special, braces must pair.
    pub fn parse(source: &str) -> Result<Self, TemplateError> {
        if source.is_empty() {
            return Err(TemplateError::Empty);
        }
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = source.char_indices().peekable();
        while let Some((at, c)) = rest.next() {
            match c {
                '{' => {
                    let mut name = String::new();
                    let mut closed = false;
                    for (_, c) in rest.by_ref() {
                        if c == '}' {
                            closed = true;
                            break;
                        }
                        name.push(c);
                    }
                    if !closed {
                        return Err(TemplateError::Unclosed(at));
                    }
                    let field = Placeholder::parse(&name)
                        .ok_or_else(|| TemplateError::UnknownPlaceholder(name.clone()))?;
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    }
                    parts.push(Part::Field(field));
                }
                '}' => return Err(TemplateError::Unmatched(at)),
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Self {
            source: source.to_owned(),
            parts,
        })
    }

    /// Renders the template for one message.
    pub fn render(&self, fields: &Fields<'_>) -> String {
        let mut out = String::with_capacity(self.source.len() + 16);
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::Field(Placeholder::AggregateType) => out.push_str(fields.aggregate_type),
                Part::Field(Placeholder::EventType) => out.push_str(fields.event_type),
                Part::Field(Placeholder::AggregateId) => {
                    out.push_str(fields.aggregate_id.unwrap_or_default())
                }
            }
        }
        out
    }

    /// Renders the template for one message, each placeholder's value passed through
    /// `encode` (which appends it to the output), literals as written: the HTTP sink
    /// percent-encodes values into a URL this way.
    pub fn render_with(&self, fields: &Fields<'_>, encode: impl Fn(&str, &mut String)) -> String {
        let mut out = String::with_capacity(self.source.len() + 16);
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::Field(Placeholder::AggregateType) => encode(fields.aggregate_type, &mut out),
                Part::Field(Placeholder::EventType) => encode(fields.event_type, &mut out),
                Part::Field(Placeholder::AggregateId) => {
                    encode(fields.aggregate_id.unwrap_or_default(), &mut out)
                }
            }
        }
        out
    }

    /// The literal text before the first placeholder (the whole template when it has none).
    pub fn literal_prefix(&self) -> &str {
        let end = self
            .parts
            .iter()
            .take_while(|p| matches!(p, Part::Literal(_)))
            .map(|p| match p {
                Part::Literal(s) => s.len(),
                Part::Field(_) => 0,
            })
            .sum();
        &self.source[..end]
    }

    /// Whether the template has no placeholder: every message renders the same text.
    pub fn is_literal(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Literal(_)))
    }

    /// The template as written in the configuration.
    pub fn as_str(&self) -> &str {
        &self.source
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIELDS: Fields<'static> = Fields {
        aggregate_type: "order",
        event_type: "created",
        aggregate_id: Some("42"),
    };

    #[test]
    fn renders_every_placeholder() {
        let t = Template::parse("{aggregate_type}.{event_type}.{aggregate_id}").unwrap();
        assert_eq!(t.render(&FIELDS), "order.created.42");
    }

    #[test]
    fn keeps_literals_around_placeholders() {
        let t = Template::parse("events-{aggregate_type}-v1").unwrap();
        assert_eq!(t.render(&FIELDS), "events-order-v1");
        assert_eq!(Template::parse("fixed").unwrap().render(&FIELDS), "fixed");
    }

    #[test]
    fn missing_aggregate_id_renders_empty() {
        let t = Template::parse("{aggregate_type}/{aggregate_id}").unwrap();
        let f = Fields {
            aggregate_id: None,
            ..FIELDS
        };
        assert_eq!(t.render(&f), "order/");
    }

    #[test]
    fn render_with_encodes_values_and_keeps_literals() {
        let t = Template::parse("a/{aggregate_type}/{aggregate_id}?b").unwrap();
        let f = Fields {
            aggregate_id: Some("x/y"),
            ..FIELDS
        };
        let out = t.render_with(&f, |v, out| out.push_str(&v.replace('/', "%2F")));
        assert_eq!(out, "a/order/x%2Fy?b");
        assert_eq!(t.literal_prefix(), "a/");
        assert_eq!(Template::parse("plain").unwrap().literal_prefix(), "plain");
        assert!(Template::parse("plain").unwrap().is_literal());
        assert!(!t.is_literal());
    }

    #[test]
    fn rejects_unknown_placeholder() {
        assert_eq!(
            Template::parse("{aggregate_type}.{tenant}"),
            Err(TemplateError::UnknownPlaceholder("tenant".into()))
        );
    }

    #[test]
    fn rejects_unbalanced_braces_and_empty() {
        assert_eq!(
            Template::parse("a.{event_type"),
            Err(TemplateError::Unclosed(2))
        );
        assert_eq!(Template::parse("a}b"), Err(TemplateError::Unmatched(1)));
        assert_eq!(Template::parse(""), Err(TemplateError::Empty));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any input either parses or is rejected with an error; never a panic.
            #[test]
            fn parse_never_panics(src in ".{0,64}") {
                if let Ok(t) = Template::parse(&src) {
                    let _ = t.render(&FIELDS);
                }
            }

            /// Literal text without braces renders as itself; placeholders render their values.
            #[test]
            fn literals_round_trip(prefix in "[a-z.\\-]{0,12}", suffix in "[a-z.\\-]{0,12}") {
                let t = Template::parse(&format!("{prefix}{{aggregate_type}}{suffix}")).unwrap();
                prop_assert_eq!(t.render(&FIELDS), format!("{prefix}order{suffix}"));
            }
        }
    }
}
