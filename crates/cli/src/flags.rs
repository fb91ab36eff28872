//! The command line's spelling of what a policy reads: the flag of each shared option, the
//! flags kept as aliases of policy settings (`--head-group N` is `headwise:group=N`), the
//! policy spec a run's flags add up to, and `--list-policies`. Only the command line
//! spells flags; the library names options by field and settings by key.
use std::fmt::Write;

use clap::parser::ValueSource;
use clap::ArgMatches;
use kvpolicy::models::ModelInput;
use kvpolicy::{PolicyOption, PolicyRegistry, PolicySpec};

/// The clap id of the flag that sets `option` (the field of [`crate::Args`]).
fn option_id(option: PolicyOption) -> &'static str {
    match option {
        PolicyOption::DeviceKvBudget => "device_kv_budget",
        PolicyOption::Profile => "profile",
        PolicyOption::LinkBandwidth => "link_bandwidth",
        PolicyOption::HostKvBudget => "host_kv_budget",
        PolicyOption::DiskDir => "disk_dir",
        PolicyOption::HostKvDtype => "host_kv_dtype",
        PolicyOption::KvDtype => "kv_dtype",
    }
}

/// The flag that sets `option`.
pub fn option_flag(option: PolicyOption) -> &'static str {
    match option {
        PolicyOption::DeviceKvBudget => "--device-kv-budget",
        PolicyOption::Profile => "--profile",
        PolicyOption::LinkBandwidth => "--link-bandwidth",
        PolicyOption::HostKvBudget => "--host-kv-budget",
        PolicyOption::DiskDir => "--disk-dir",
        PolicyOption::HostKvDtype => "--host-kv-dtype",
        PolicyOption::KvDtype => "--kv-dtype",
    }
}

/// A flag kept as an alias of a policy setting.
pub struct SettingFlag {
    /// The flag, e.g. `--head-group`.
    pub flag: &'static str,
    /// Its clap id.
    pub id: &'static str,
    /// The setting key it sets.
    pub key: &'static str,
}

/// The setting aliases: each sets its key on the policy that has it.
pub const SETTING_FLAGS: [SettingFlag; 4] = [
    SettingFlag {
        flag: "--head-group",
        id: "head_group",
        key: "group",
    },
    SettingFlag {
        flag: "--recompute-split",
        id: "recompute_split",
        key: "split",
    },
    SettingFlag {
        flag: "--block-size",
        id: "block_size",
        key: "block_size",
    },
    SettingFlag {
        flag: "--kv-act-ratio",
        id: "kv_act_ratio",
        key: "kv_act_ratio",
    },
];

/// The flag aliasing setting `key`, if one does.
pub fn setting_flag(key: &str) -> Option<&'static str> {
    SETTING_FLAGS.iter().find(|f| f.key == key).map(|f| f.flag)
}

/// The spec the run asks for: `--policy`'s spec with the alias flags given on the command
/// line put first (so a key the spec sets itself wins), and a warning for each alias or
/// option flag the policy does not read — save the options in `caller_reads`, which the
/// program reads itself (the server's swap space under `--disk-dir`). An unknown policy adds
/// nothing and warns of nothing (building it fails with the list of names).
pub fn run_spec(
    reg: &PolicyRegistry,
    matches: &ArgMatches,
    policy: &str,
    caller_reads: &[PolicyOption],
) -> anyhow::Result<(PolicySpec, Vec<String>)> {
    let mut spec = PolicySpec::parse(policy)?;
    let Ok(info) = reg.info(&spec.name) else {
        return Ok((spec, Vec::new()));
    };
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let mut warnings = Vec::new();
    let mut aliases = PolicySpec::named(&spec.name);
    for f in &SETTING_FLAGS {
        if !given(f.id) {
            continue;
        }
        if info.has_setting(f.key) {
            if let Some(v) = matches.get_raw(f.id).and_then(|mut v| v.next()) {
                aliases = aliases.with(f.key, v.to_string_lossy());
            }
        } else {
            warnings.push(format!(
                "warning: {} does not apply to the `{}` policy and is ignored (it is read by {})",
                f.flag,
                spec.name,
                reg.setting_owners(f.key).join(", ")
            ));
        }
    }
    for o in PolicyOption::ALL {
        let flag = option_flag(o);
        let read = info.reads.contains(&o) || caller_reads.contains(&o);
        if given(option_id(o)) && !read {
            warnings.push(format!(
                "warning: {flag} does not apply to the `{}` policy and is ignored (it is read by {})",
                spec.name,
                reg.readers(o).join(", ")
            ));
        }
    }
    aliases.settings.append(&mut spec.settings);
    spec.settings = aliases.settings;
    Ok((spec, warnings))
}

/// `--list-policies`: every policy with its description and settings (key, type, default,
/// docs), and for the runner (`with_flags`) the flag that aliases each setting and the
/// shared options' flags the policy reads (kvbench has neither: its settings are specs).
pub fn list_policies(reg: &PolicyRegistry, with_flags: bool) -> String {
    let mut out = String::new();
    for p in reg.policies() {
        let _ = writeln!(out, "{}\n    {}", p.name, p.description);
        if p.settings.is_empty() {
            let _ = writeln!(out, "    settings: none");
        }
        for s in &p.settings {
            let alias = match (setting_flag(&s.key), s.key.as_str()) {
                _ if !with_flags => String::new(),
                (Some(f), _) => format!("; flag {f}"),
                (None, "budget") => format!("; flag {}", option_flag(PolicyOption::DeviceKvBudget)),
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "    {}:{}=<{}> (default {}{alias})\n        {}",
                p.name, s.key, s.kind, s.default, s.doc
            );
        }
        let reads: Vec<&str> = p.reads.iter().map(|o| option_flag(*o)).collect();
        if with_flags && !reads.is_empty() {
            let _ = writeln!(out, "    reads: {}", reads.join(" "));
        }
    }
    let _ = write!(
        out,
        "\nA spec sets settings after a colon: NAME:KEY=VALUE,KEY=VALUE (e.g. headwise:group=1); a lone value sets the first one (headwise:1, auto:64MiB)."
    );
    out
}

/// The flag that gives a model input: how the runner's messages name it.
pub fn input_flag(input: ModelInput) -> &'static str {
    match input {
        ModelInput::Gguf => "--gguf",
        ModelInput::ModelDir => "--model-dir",
        ModelInput::ModelSource => "--gguf/--model-dir",
        ModelInput::Config => "--config",
        ModelInput::Tokenizer => "--tokenizer",
        ModelInput::Prompt => "--prompt TEXT or --prompt-ids",
        ModelInput::MaxNewTokens => "--max-new-tokens",
        ModelInput::Temperature => "--temperature",
        ModelInput::TopP => "--top-p",
        ModelInput::DecodeIds => "--decode-ids",
        ModelInput::Chat => "--chat",
    }
}
