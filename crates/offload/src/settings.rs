//! `headwise`'s settings: how many KV heads one streamed unit holds (HeadInfer §3.3).
use schemars::JsonSchema;

/// How many KV heads a head-wise unit holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeadGroup {
    /// Chosen from the device budget and the context length (HeadInfer §3.3).
    #[default]
    Auto,
    /// A fixed number of KV heads (must divide the model's KV heads).
    Fixed(usize),
}

impl std::str::FromStr for HeadGroup {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Self::Fixed(n)),
            _ => Err(format!(
                "`{s}` is neither `auto` nor a positive number of KV heads"
            )),
        }
    }
}

impl std::fmt::Display for HeadGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Fixed(n) => write!(f, "{n}"),
        }
    }
}

impl serde::Serialize for HeadGroup {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for HeadGroup {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for HeadGroup {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "HeadGroup".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "string", "format": "auto|N"})
    }
}

/// `headwise`'s settings.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize, JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct HeadwiseSettings {
    /// KV heads per streamed unit: a divisor of the model's KV heads, or `auto` (the largest
    /// group the device budget holds; without one, smaller groups as the context grows).
    pub group: HeadGroup,
}
