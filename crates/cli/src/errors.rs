//! The policy layer's errors in the command line's words: an option or setting named by
//! the flag (or spec key) that sets it, and a budget error's [`Advice`] rendered as what to
//! change on the command line; a model error's inputs ([`ModelInput`](kvpolicy::models::ModelInput))
//! by their flags. The library's errors carry these as data ([`Knob`], [`Advice`],
//! `ModelInput`); this renders them by `match`, not by rewriting the library's text.
use kvpolicy::core::error::budget_text;
use kvpolicy::core::Advice;
use kvpolicy::models::ModelError;
use kvpolicy::{Knob, KvError, PolicyOption};

use crate::flags::{input_flag, option_flag, setting_flag};

/// Which command line the message is for: the runner's flags, or kvbench's, where
/// settings are only given in `--policies` specs and the device budget is `auto:BUDGET`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frontend {
    /// The examples' runner (`--policy`, `--head-group`, `--device-kv-budget`, …).
    Runner,
    /// kvbench (`--policies headwise:group=1,auto:budget=64MiB`).
    Kvbench,
}

/// How `knob` is set from `front`.
fn knob_text(knob: Knob, front: Frontend) -> String {
    match (knob, front) {
        (Knob::Option(PolicyOption::DeviceKvBudget), Frontend::Kvbench) => {
            "the budget (POLICY:budget=SIZE in --policies)".to_string()
        }
        (Knob::Option(o), _) => option_flag(o).to_string(),
        (Knob::Setting(k), Frontend::Runner) => match setting_flag(k) {
            Some(flag) => flag.to_string(),
            None => format!("`{k}` (POLICY:{k}=VALUE in --policy)"),
        },
        (Knob::Setting(k), Frontend::Kvbench) => format!("`{k}` (POLICY:{k}=VALUE in --policies)"),
    }
}

/// `bytes` rounded up to a whole number of the largest binary unit it reaches, written as
/// a size flag takes it (`69KiB`, `13MiB`): a value to type that is never below `bytes`.
pub fn size_arg(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (unit, size) in UNITS {
        if bytes >= size {
            return format!("{}{unit}", bytes.div_ceil(size));
        }
    }
    format!("{bytes}B")
}

/// One piece of advice as a command-line change; `least` is the smallest device budget
/// that would have held what was asked for (budgets the message names it with).
fn advice_text(a: &Advice, front: Frontend, least: u64) -> String {
    match (a, front) {
        (Advice::Raise(k @ Knob::Option(PolicyOption::DeviceKvBudget)), _) => {
            format!(
                "raise {} to at least {}",
                knob_text(*k, front),
                size_arg(least)
            )
        }
        (Advice::Raise(k), _) => format!("raise {}", knob_text(*k, front)),
        (Advice::Lower(Knob::Setting("group")), Frontend::Runner) => {
            "use a smaller head group (--head-group N, or --policy headwise:group=N)".into()
        }
        (Advice::Lower(Knob::Setting("group")), Frontend::Kvbench) => {
            "use a smaller head group (headwise:group=N in --policies)".into()
        }
        (Advice::Lower(k), _) => format!("use a smaller {}", knob_text(*k, front)),
        (Advice::UsePolicy(p), Frontend::Runner) => format!("use `--policy {p}`"),
        (Advice::UsePolicy(p), Frontend::Kvbench) => format!("use the `{p}` policy"),
        (Advice::SmallerPrefillChunk, _) => "use a smaller --prefill-chunk".into(),
        (Advice::ShorterRequests, _) => "shorten the requests".into(),
    }
}

/// `e`'s message for `front`.
pub fn kv_for_cli(e: &KvError, front: Frontend) -> String {
    match e {
        KvError::BudgetExceeded {
            what,
            needed,
            budget,
            in_use,
            note,
            advice,
        } => {
            let least = in_use.saturating_add(*needed);
            let advice: Vec<String> = advice
                .iter()
                .map(|a| advice_text(a, front, least))
                .collect();
            budget_text(what, *needed, *budget, *in_use, note, &advice)
        }
        KvError::InvalidOption {
            policy,
            option,
            message,
        } => {
            // The message goes on after the value's name: `--head-group 3 does not…`, or
            // the spec's own spelling, `headwise:group=3 does not…`.
            let named = match (option, front) {
                (Knob::Setting(k), Frontend::Runner) if setting_flag(k).is_some() => {
                    knob_text(*option, front) + " "
                }
                (Knob::Setting(k), _) => format!("{policy}:{k}="),
                (Knob::Option(_), _) => knob_text(*option, front) + " ",
            };
            format!("invalid option for the `{policy}` policy: {named}{message}")
        }
        // Which names exist, and where each is described.
        KvError::UnknownPolicy { .. } => {
            let flag = match front {
                Frontend::Runner => "--policy NAME",
                Frontend::Kvbench => "--policies NAME,…",
            };
            format!("{e}; give one of them as {flag} (--list-policies describes each)")
        }
        KvError::UnknownSetting { policy, valid, .. } => {
            let flag = match front {
                Frontend::Runner => "--policy",
                Frontend::Kvbench => "--policies",
            };
            match valid.first() {
                Some(key) => format!(
                    "{e}; write {flag} {policy}:{key}=VALUE (--list-policies lists each setting)"
                ),
                None => format!("{e}; give {flag} {policy} alone"),
            }
        }
        // The disk tier's files live under the directory the user named.
        KvError::Disk { what, .. } => {
            format!("disk tier ({}): {what}", option_flag(PolicyOption::DiskDir))
        }
        other => other.to_string(),
    }
}

/// Opening the GPU failed (`--cpu` not given, in a build with the `cuda` feature: a machine
/// without a GPU, or without a driver that can open it): `e` as one line naming the fix.
pub fn no_gpu(e: anyhow::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot open a CUDA GPU: {e:#}; this build has the `cuda` feature and uses the GPU unless told otherwise: run with --cpu, or check the GPU and its driver with `nvidia-smi`"
    )
}

/// `e` with its causes (as `{e:#}` prints them), every policy error in the chain rendered
/// by [`kv_for_cli`].
pub fn for_cli(e: &anyhow::Error, front: Frontend) -> String {
    let parts: Vec<String> = e
        .chain()
        .map(|cause| {
            match (
                cause.downcast_ref::<KvError>(),
                cause.downcast_ref::<ModelError>(),
            ) {
                (Some(kv), _) | (None, Some(ModelError::Policy(kv))) => kv_for_cli(kv, front),
                (None, Some(m)) => m.render(&|i| input_flag(i).to_string()),
                _ => cause.to_string(),
            }
        })
        .collect();
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_to_type_round_up() {
        assert_eq!(size_arg(1), "1B");
        assert_eq!(size_arg(1023), "1023B");
        assert_eq!(size_arg(1024), "1KiB");
        assert_eq!(size_arg(70_480), "69KiB");
        assert_eq!(size_arg((12 << 20) + 1), "13MiB");
        assert_eq!(size_arg(3 << 30), "3GiB");
        for b in [1u64, 1023, 1025, 70_480, (12 << 20) + 1, (5 << 40) + 7] {
            let typed = kvpolicy::core::parse_bytes(&size_arg(b)).unwrap_or(0);
            assert!(typed >= b, "{b} → {}", size_arg(b));
        }
    }

    /// A budget too small names the budget that would hold what was asked for.
    #[test]
    fn a_budget_too_small_names_the_budget_that_fits() {
        let e = KvError::BudgetExceeded {
            what: "two buffers".into(),
            needed: 70_000,
            budget: 1024,
            in_use: 512,
            note: "",
            advice: vec![
                Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)),
                Advice::SmallerPrefillChunk,
            ],
        };
        let m = kv_for_cli(&e, Frontend::Runner);
        assert!(
            m.ends_with(
                "; raise --device-kv-budget to at least 69KiB, or use a smaller --prefill-chunk"
            ),
            "{m}"
        );
        let m = kv_for_cli(&e, Frontend::Kvbench);
        assert!(
            m.contains("raise the budget (POLICY:budget=SIZE in --policies) to at least 69KiB"),
            "{m}"
        );
    }

    #[test]
    fn unknown_names_say_where_the_valid_ones_go() {
        let e = KvError::UnknownPolicy {
            name: "nonesuch".into(),
            valid: "full, layer".into(),
        };
        let m = kv_for_cli(&e, Frontend::Runner);
        assert!(m.starts_with("unknown KV policy `nonesuch`; valid policies are: full, layer; "));
        assert!(
            m.ends_with("give one of them as --policy NAME (--list-policies describes each)"),
            "{m}"
        );
        assert!(kv_for_cli(&e, Frontend::Kvbench).contains("--policies NAME"));

        let e = KvError::UnknownSetting {
            policy: "headwise".into(),
            key: "nope".into(),
            valid: vec!["group".into(), "budget".into()],
        };
        let m = kv_for_cli(&e, Frontend::Runner);
        assert!(
            m.contains("its settings are: group, budget; write --policy headwise:group=VALUE"),
            "{m}"
        );
        let e = KvError::UnknownSetting {
            policy: "solo".into(),
            key: "x".into(),
            valid: vec![],
        };
        assert!(kv_for_cli(&e, Frontend::Runner)
            .ends_with("it takes no settings; give --policy solo alone"));
    }

    /// A `cuda` build without a usable GPU (checked here: the tests' builds have no `cuda`).
    #[test]
    fn a_gpu_that_cannot_be_opened_names_cpu() {
        let cause = anyhow::anyhow!(
            "DriverError(CUDA_ERROR_NO_DEVICE, \"no CUDA-capable device is detected\")"
        )
        .context("rank 1 of 2 could not open GPU 1");
        let m = for_cli(&no_gpu(cause), Frontend::Runner);
        assert!(m.starts_with("cannot open a CUDA GPU: rank 1 of 2 could not open GPU 1: DriverError(CUDA_ERROR_NO_DEVICE"), "{m}");
        assert!(
            m.contains("run with --cpu, or check the GPU and its driver with `nvidia-smi`"),
            "{m}"
        );
        assert!(!m.contains('\n'), "{m}");
    }
}
