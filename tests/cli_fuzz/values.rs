//! The CLI fuzz's value tables: counts, floats, sizes, ids, names and config fields, with
//! the values no flag accepts.
pub const COUNTS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "7",
    "16",
    "64",
    "127",
    "128",
    "129",
    "1000",
    "1000000000",
    "4294967296",
    "18446744073709551615",
];
/// Values no flag accepts (clap's usage errors), given one time in ten.
pub const BAD: &[&str] = &[
    "18446744073709551616",
    "-1",
    "1.5",
    "",
    "x",
    "\u{661}",
    "1e3",
    "0x10",
];
pub const FLOATS: &[&str] = &[
    "0",
    "1",
    "0.5",
    "0.9",
    "1.0000001",
    "2",
    "-1",
    "-0",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "1e308",
    "1e-320",
];
pub const SIZES: &[&str] = &[
    "0",
    "1",
    "1B",
    "4096",
    "64KiB",
    "1MiB",
    "64MiB",
    "1.5GB",
    "1000000000000TiB",
    "18446744073709551615",
    "18446744073709551616",
    "12 parsecs",
];
/// Link bandwidths: fast enough that a run ends (a slow link warns and then crawls by
/// design), and malformed ones.
pub const LINKS: &[&str] = &["1GB", "25GB", "1TiB", "0", "1000000000000TiB"];
pub const IDS: &[&str] = &[
    "1,2,3",
    "1",
    "0",
    "383",
    "384",
    "4294967295",
    "4294967296",
    "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20",
];
pub const POLICIES: &[&str] = &[
    "full",
    "layer",
    "headwise",
    "recompute",
    "hybrid",
    "auto",
    "",
    "FULL",
];
pub const TEXTS: &[&str] = &[
    "The capital of France is",
    "",
    " ",
    "\u{1F600}\u{7f}",
    "a\nb",
];
pub const DTYPES: &[&str] = &["f32", "f16", "bf16", "f64", "u8", ""];
pub const GROUPS: &[&str] = &[
    "auto",
    "1",
    "2",
    "3",
    "4",
    "0",
    "99999999999999999999",
    "AUTO",
];
/// Config fields set to an absurd value in a copy of the fixture's config.json.
pub const FIELDS: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "sliding_window",
    "tie_word_embeddings",
    "rope_scaling",
    "model_type",
];
