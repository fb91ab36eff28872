//! A policy's own settings, and the spec string that names a policy with them.
//!
//! Each policy declares one typed settings struct — serde for parsing, schemars for the
//! listing (its `///` docs, types and defaults) — next to the [`PolicyOptions`] every
//! policy shares. A [`PolicySpec`] names a policy and sets some of its settings:
//! `headwise:group=1`, `sinks:sinks=4,window=256`, or the shorthand `headwise:1` for the
//! policy's first setting. [`PolicyRegistry`](crate::PolicyRegistry) resolves a spec
//! against what the policy declares; an unknown key or a bad value is a typed error naming
//! the policy, the key and the valid keys.
//!
//! A settings struct derives `Deserialize`, `JsonSchema` and `Default` (and `Serialize`, so
//! that listings show its defaults), with `#[serde(default, deny_unknown_fields)]`:
//!
//! ```
//! use kvpolicy_core::settings::{describe, PolicySettings};
//! /// `window`'s settings.
//! #[derive(Debug, Default, serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
//! #[serde(default, deny_unknown_fields)]
//! struct Window {
//!     /// Recent tokens kept per layer.
//!     tokens: usize,
//! }
//! let docs = describe::<Window>();
//! assert_eq!(docs[0].key, "tokens");
//! assert_eq!(docs[0].doc, "Recent tokens kept per layer.");
//! ```
//!
//! [`PolicyOptions`]: crate::PolicyOptions
use std::fmt;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{KvError, Result};

/// A policy's settings struct: parsed from `key=value` pairs, described from its schema.
pub trait PolicySettings: DeserializeOwned + JsonSchema + Default + Send + Sync + 'static {}
impl<T: DeserializeOwned + JsonSchema + Default + Send + Sync + 'static> PolicySettings for T {}

/// The settings of a policy that has none of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoSettings {}

/// One `key=value` of a spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingValue {
    /// The setting's key; `None` for the shorthand `name:value`, which sets the policy's
    /// first setting.
    pub key: Option<String>,
    /// The value as written.
    pub value: String,
}

/// A policy named with some of its settings: `name`, `name:value` or
/// `name:key=value,key=value`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    /// The registry name.
    pub name: String,
    /// The settings given, in order (a later value of a key wins).
    pub settings: Vec<SettingValue>,
}

impl PolicySpec {
    /// A spec naming `name` with no settings.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.to_string(),
            settings: Vec::new(),
        }
    }

    /// The spec with `key=value` added after the settings it has.
    pub fn with(mut self, key: &str, value: impl fmt::Display) -> Self {
        self.settings.push(SettingValue {
            key: Some(key.to_string()),
            value: value.to_string(),
        });
        self
    }

    /// Parses `name`, `name:value` or `name:key=value,key=value`.
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = |reason: &str| KvError::BadSpec {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        let (name, rest) = match spec.split_once(':') {
            Some((n, r)) => (n.trim(), Some(r)),
            None => (spec.trim(), None),
        };
        if name.is_empty() {
            return Err(bad("it names no policy before the settings"));
        }
        let mut settings = Vec::new();
        if let Some(rest) = rest {
            if rest.trim().is_empty() {
                return Err(bad("nothing follows the colon"));
            }
            let parts: Vec<&str> = rest.split(',').collect();
            for part in &parts {
                let setting = match part.split_once('=') {
                    Some((k, v)) => {
                        let (k, v) = (k.trim(), v.trim());
                        if k.is_empty() {
                            return Err(bad(&format!("`{part}` has no key before `=`")));
                        }
                        if v.is_empty() {
                            return Err(bad(&format!("`{k}` has no value after `=`")));
                        }
                        SettingValue {
                            key: Some(k.to_string()),
                            value: v.to_string(),
                        }
                    }
                    None if parts.len() == 1 => SettingValue {
                        key: None,
                        value: part.trim().to_string(),
                    },
                    None => {
                        return Err(bad(&format!(
                            "`{part}` is not `key=value` (only a lone value may leave out the key)"
                        )))
                    }
                };
                settings.push(setting);
            }
        }
        Ok(Self {
            name: name.to_string(),
            settings,
        })
    }
}

impl std::str::FromStr for PolicySpec {
    type Err = KvError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

impl fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)?;
        for (i, s) in self.settings.iter().enumerate() {
            f.write_str(if i == 0 { ":" } else { "," })?;
            match &s.key {
                Some(k) => write!(f, "{k}={}", s.value)?,
                None => write!(f, "{}", s.value)?,
            }
        }
        Ok(())
    }
}

/// One declared setting, as listings print it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SettingDoc {
    /// Its key in a spec.
    pub key: String,
    /// Its type: `integer`, `number`, `boolean`, `string`, or the format a custom type
    /// declares (`bytes`, `auto|N`).
    pub kind: String,
    /// Its default, as a spec would write it (`unset` for an optional one).
    pub default: String,
    /// Its `///` documentation.
    pub doc: String,
}

/// The settings `S` declares, in declaration order.
pub fn describe<S: JsonSchema>() -> Vec<SettingDoc> {
    let schema = schemars::schema_for!(S);
    let Some(props) = schema.get("properties").and_then(Value::as_object) else {
        return Vec::new();
    };
    props
        .iter()
        .map(|(key, p)| SettingDoc {
            key: key.clone(),
            kind: kind_of(p),
            default: match p.get("default") {
                None | Some(Value::Null) => "unset".to_string(),
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
            },
            doc: p
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        })
        .collect()
}

/// A property's type as a word.
fn kind_of(p: &Value) -> String {
    if let Some(f) = p.get("format").and_then(Value::as_str) {
        if !matches!(
            f,
            "uint" | "uint8" | "uint16" | "uint32" | "uint64" | "int" | "int32" | "int64"
        ) && !matches!(f, "float" | "double")
        {
            return f.to_string();
        }
    }
    let types: Vec<&str> = match p.get("type") {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let word = types
        .iter()
        .find(|t| **t != "null")
        .copied()
        .unwrap_or("value");
    let unsigned = p.get("minimum").and_then(Value::as_f64) == Some(0.0);
    match word {
        "integer" if unsigned => "integer >= 0".to_string(),
        w => w.to_string(),
    }
}

/// One key's value, after a spec has been resolved against a policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The declared key.
    pub key: String,
    /// The value as written.
    pub value: String,
}

/// Parses `S` from resolved `settings` of `policy`: each value alone first, so that an
/// error names its key, then all together.
pub fn parse_settings<S: PolicySettings>(policy: &str, settings: &[Setting]) -> Result<S> {
    let docs = describe::<S>();
    let encode = |pairs: &[(&str, &str)]| {
        serde_urlencoded::to_string(pairs).map_err(|e| {
            KvError::invariant(format!("encoding the settings of `{policy}` failed: {e}"))
        })
    };
    for s in settings {
        let one = encode(&[(s.key.as_str(), s.value.as_str())])?;
        if let Err(e) = serde_urlencoded::from_str::<S>(&one) {
            let kind = docs
                .iter()
                .find(|d| d.key == s.key)
                .map(|d| d.kind.clone())
                .unwrap_or_default();
            return Err(KvError::BadSetting {
                policy: policy.to_string(),
                key: s.key.clone(),
                value: s.value.clone(),
                reason: format!("{e} (expected: {kind})"),
            });
        }
    }
    let pairs: Vec<(&str, &str)> = settings
        .iter()
        .map(|s| (s.key.as_str(), s.value.as_str()))
        .collect();
    serde_urlencoded::from_str::<S>(&encode(&pairs)?).map_err(|e| KvError::BadSetting {
        policy: policy.to_string(),
        key: pairs.iter().map(|p| p.0).collect::<Vec<_>>().join(", "),
        value: String::new(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings of a test policy.
    #[derive(Debug, Default, PartialEq, serde::Deserialize, serde::Serialize, JsonSchema)]
    #[serde(default, deny_unknown_fields)]
    struct Two {
        /// First.
        a: usize,
        /// Second.
        b: Option<f64>,
    }

    fn set(k: &str, v: &str) -> Setting {
        Setting {
            key: k.into(),
            value: v.into(),
        }
    }

    #[test]
    fn specs_parse_and_print_back() -> Result<()> {
        for s in [
            "full",
            "headwise:1",
            "sinks:sinks=4,window=256",
            "auto:budget=64MiB",
        ] {
            assert_eq!(PolicySpec::parse(s)?.to_string(), s);
        }
        let p = PolicySpec::parse("headwise:group=2")?;
        assert_eq!(p.name, "headwise");
        assert_eq!(p.settings[0].key.as_deref(), Some("group"));
        for bad in ["", ":1", "headwise:", "a:=1", "a:k=", "a:1,2", "a:k=1,2"] {
            assert!(
                matches!(PolicySpec::parse(bad), Err(KvError::BadSpec { .. })),
                "{bad}"
            );
        }
        Ok(())
    }

    #[test]
    fn settings_parse_with_their_keys_named_in_errors() -> Result<()> {
        let two: Two = parse_settings("p", &[set("a", "3"), set("b", "0.5")])?;
        assert_eq!(two, Two { a: 3, b: Some(0.5) });
        assert_eq!(parse_settings::<Two>("p", &[])?, Two::default());
        let bad = parse_settings::<Two>("p", &[set("b", "0.5"), set("a", "x")]);
        assert!(
            matches!(&bad, Err(KvError::BadSetting { key, reason, .. }) if key == "a" && reason.contains("(expected: integer >= 0)")),
            "{bad:?}"
        );
        let docs = describe::<Two>();
        assert_eq!(
            docs.iter().map(|d| d.key.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(docs[1].default, "unset");
        assert_eq!(docs[1].doc, "Second.");
        Ok(())
    }
}
