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

/// One piece of advice as a command-line change.
fn advice_text(a: &Advice, front: Frontend) -> String {
    match (a, front) {
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
            let advice: Vec<String> = advice.iter().map(|a| advice_text(a, front)).collect();
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
        // The disk tier's files live under the directory the user named.
        KvError::Disk { what, .. } => {
            format!("disk tier ({}): {what}", option_flag(PolicyOption::DiskDir))
        }
        other => other.to_string(),
    }
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
