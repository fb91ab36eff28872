//! Building a policy from a spec at run time: `Box<dyn KvPolicy>` for CLIs and for users
//! who pick a policy in configuration. Each policy crate registers its builders — closures
//! over the shared [`PolicyOptions`] and the policy's own typed settings
//! ([`crate::settings`]); the facade crate `kvpolicy` returns a registry that holds all of
//! them, and a downstream crate adds its own the same way.
//!
//! ```
//! use kvpolicy_core::settings::NoSettings;
//! use kvpolicy_core::{PolicyOptions, PolicyRegistry};
//! # use kvpolicy_core::{AttnStep, KvPolicy, KvStats, Result};
//! # struct Mine;
//! # impl KvPolicy for Mine {
//! #     fn name(&self) -> &str { "mine" }
//! #     fn attend(&mut self, _: &AttnStep<'_>) -> Result<candle_core::Tensor> { unimplemented!() }
//! #     fn seq_len(&self) -> usize { 0 }
//! #     fn reset(&mut self) {}
//! #     fn stats(&self) -> KvStats { KvStats::default() }
//! # }
//! let mut reg = PolicyRegistry::new();
//! reg.register("mine", "my policy", &[], |_opts: &PolicyOptions, _: NoSettings| {
//!     Ok(Box::new(Mine))
//! });
//! assert_eq!(reg.build("mine", &PolicyOptions::default())?.name(), "mine");
//! assert!(reg.build("mine:k=1", &PolicyOptions::default()).is_err());
//! # Ok::<(), kvpolicy_core::KvError>(())
//! ```
use std::sync::Arc;

use crate::batch::PerSequence;
use crate::error::{KvError, Result};
use crate::knob::PolicyOption;
use crate::options::PolicyOptions;
use crate::policy::KvPolicy;
use crate::settings::{describe, parse_settings, PolicySettings, PolicySpec, Setting, SettingDoc};

/// The key every policy that reads [`PolicyOption::DeviceKvBudget`] takes in a spec: the
/// device KV budget as a size (`auto:budget=64MiB`, or `auto:64MiB`).
pub const BUDGET_KEY: &str = "budget";

/// Builds a policy from the shared options and its resolved settings.
pub type PolicyBuilder =
    Arc<dyn Fn(&PolicyOptions, &[Setting]) -> Result<Box<dyn KvPolicy>> + Send + Sync>;

/// What the registry knows of one policy.
#[derive(Clone)]
pub struct PolicyInfo {
    /// Its name.
    pub name: &'static str,
    /// One line saying what it does (approximate ones say so first).
    pub description: &'static str,
    /// The shared options it reads.
    pub reads: &'static [PolicyOption],
    /// Its settings, in declaration order, then `budget` when it reads the device budget.
    pub settings: Vec<SettingDoc>,
    /// Whether `budget` in a spec sets the shared device budget (the policy reads it and
    /// declares no `budget` setting of its own).
    budget_option: bool,
    builder: PolicyBuilder,
}

impl PolicyInfo {
    /// The key a lone value (`headwise:1`) sets: the first setting.
    pub fn shorthand(&self) -> Option<&str> {
        self.settings.first().map(|s| s.key.as_str())
    }

    /// Whether `key` is one of its settings.
    pub fn has_setting(&self, key: &str) -> bool {
        self.settings.iter().any(|s| s.key == key)
    }
}

/// A spec resolved against its policy: the options to build with and the settings.
struct Resolved<'a> {
    info: &'a PolicyInfo,
    opts: PolicyOptions,
    settings: Vec<Setting>,
}

/// Named policy builders.
#[derive(Clone, Default)]
pub struct PolicyRegistry {
    entries: Vec<PolicyInfo>,
}

impl PolicyRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a policy under `name`, with a one-line description, the shared
    /// options it reads and its builder, which receives the options and its settings `S`
    /// parsed from the spec (defaults for what the spec leaves out).
    pub fn register<S, F>(
        &mut self,
        name: &'static str,
        description: &'static str,
        reads: &'static [PolicyOption],
        build: F,
    ) where
        S: PolicySettings,
        F: Fn(&PolicyOptions, S) -> Result<Box<dyn KvPolicy>> + Send + Sync + 'static,
    {
        let mut settings = describe::<S>();
        let budget_option = reads.contains(&PolicyOption::DeviceKvBudget)
            && !settings.iter().any(|s| s.key == BUDGET_KEY);
        if budget_option {
            settings.push(SettingDoc {
                key: BUDGET_KEY.to_string(),
                kind: "bytes".to_string(),
                default: "unset".to_string(),
                doc: "Device-tier byte budget for KV buffers, e.g. 64MiB (sets `device_kv_budget`; unset: unlimited)."
                    .to_string(),
            });
        }
        let builder: PolicyBuilder =
            Arc::new(move |opts, settings| build(opts, parse_settings::<S>(name, settings)?));
        self.entries.retain(|e| e.name != name);
        self.entries.push(PolicyInfo {
            name,
            description,
            reads,
            settings,
            budget_option,
            builder,
        });
    }

    /// What the registry knows of `name`, or an error listing the valid names.
    pub fn info(&self, name: &str) -> Result<&PolicyInfo> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| KvError::UnknownPolicy {
                name: name.to_string(),
                valid: self.names().join(", "),
            })
    }

    /// Every policy, in registration order.
    pub fn policies(&self) -> &[PolicyInfo] {
        &self.entries
    }

    /// Registered names, in registration order.
    pub fn names(&self) -> Vec<&'static str> {
        self.entries.iter().map(|e| e.name).collect()
    }

    /// Names with their descriptions.
    pub fn describe(&self) -> Vec<(&'static str, &'static str)> {
        self.entries
            .iter()
            .map(|e| (e.name, e.description))
            .collect()
    }

    /// The options policy `name` reads (the rest of [`PolicyOptions`] it ignores).
    pub fn reads(&self, name: &str) -> Result<&'static [PolicyOption]> {
        Ok(self.info(name)?.reads)
    }

    /// The policies that read `option`, in registration order.
    pub fn readers(&self, option: PolicyOption) -> Vec<&'static str> {
        self.entries
            .iter()
            .filter(|e| e.reads.contains(&option))
            .map(|e| e.name)
            .collect()
    }

    /// The policies that have a setting `key`, in registration order.
    pub fn setting_owners(&self, key: &str) -> Vec<&'static str> {
        self.entries
            .iter()
            .filter(|e| e.has_setting(key))
            .map(|e| e.name)
            .collect()
    }

    /// Resolves `spec` against its policy: every key declared (a lone value sets the
    /// shorthand), `budget` moved into the options, a later value of a key winning.
    fn resolve(&self, spec: &PolicySpec, opts: &PolicyOptions) -> Result<Resolved<'_>> {
        let info = self.info(&spec.name)?;
        let mut opts = opts.clone();
        let mut settings: Vec<Setting> = Vec::new();
        let valid = || info.settings.iter().map(|s| s.key.clone()).collect();
        for s in &spec.settings {
            let key = match (&s.key, info.shorthand()) {
                (Some(k), _) => k.clone(),
                (None, Some(k)) => k.to_string(),
                (None, None) => {
                    return Err(KvError::BadSpec {
                        spec: spec.to_string(),
                        reason: format!(
                            "`{}` takes no settings, so the value `{}` sets nothing",
                            info.name, s.value
                        ),
                    })
                }
            };
            if !info.has_setting(&key) {
                return Err(KvError::UnknownSetting {
                    policy: info.name.to_string(),
                    key,
                    valid: valid(),
                });
            }
            if key == BUDGET_KEY && info.budget_option {
                let bytes =
                    crate::size::parse_bytes(&s.value).map_err(|e| KvError::BadSetting {
                        policy: info.name.to_string(),
                        key: key.clone(),
                        value: s.value.clone(),
                        reason: format!("{e} (expected: bytes, e.g. 64MiB)"),
                    })?;
                opts.device_kv_budget = Some(bytes);
                continue;
            }
            settings.retain(|x| x.key != key);
            settings.push(Setting {
                key,
                value: s.value.clone(),
            });
        }
        Ok(Resolved {
            info,
            opts,
            settings,
        })
    }

    /// Builds the policy `spec` names (`headwise`, `headwise:group=1`, `auto:64MiB`), or
    /// fails naming what is wrong: an unknown policy (listing the valid names), an unknown
    /// setting (listing the policy's keys) or a bad value.
    pub fn build(&self, spec: &str, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>> {
        self.build_spec(&PolicySpec::parse(spec)?, opts)
    }

    /// [`build`](Self::build) for a parsed spec.
    pub fn build_spec(&self, spec: &PolicySpec, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>> {
        let r = self.resolve(spec, opts)?;
        (r.info.builder)(&r.opts, &r.settings)
    }

    /// Builds `spec` for ragged batches of requests: the policy itself when it keeps one
    /// cache per sequence ([`KvPolicy::as_batched`]), otherwise one instance per request
    /// through [`PerSequence`].
    pub fn build_batched(&self, spec: &str, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>> {
        self.build_batched_spec(&PolicySpec::parse(spec)?, opts)
    }

    /// [`build_batched`](Self::build_batched) for a parsed spec.
    pub fn build_batched_spec(
        &self,
        spec: &PolicySpec,
        opts: &PolicyOptions,
    ) -> Result<Box<dyn KvPolicy>> {
        let r = self.resolve(spec, opts)?;
        let mut first = (r.info.builder)(&r.opts, &r.settings)?;
        if first.as_batched().is_some() {
            return Ok(first);
        }
        let builder = r.info.builder.clone();
        let (opts, settings) = (r.opts, r.settings);
        Ok(Box::new(PerSequence::new(
            first.name(),
            Box::new(move || builder(&opts, &settings)),
        )))
    }
}
