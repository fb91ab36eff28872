//! The policy layer's errors in the examples' words: options named by their flags
//! (`device_kv_budget` → `--device-kv-budget`) and the budget advice as flags to change
//! (the library's messages describe the problem; this maps them onto the command line).
use kvpolicy::core::error::advice_text;
use kvpolicy::core::Advice;
use kvpolicy::models::ModelError;
use kvpolicy::{KvError, PolicyOption};

/// One piece of advice as a command-line change.
fn advice_flag(a: &Advice) -> String {
    match a {
        Advice::Raise(o) => format!("raise {}", o.flag()),
        Advice::Lower(PolicyOption::HeadGroup) => {
            "use a smaller head group (--head-group N; headwise:N in kvbench's --policies)".into()
        }
        Advice::Lower(o) => format!("use a smaller {}", o.flag()),
        Advice::UsePolicy(p) => format!("use `--policy {p}`"),
        Advice::SmallerPrefillChunk => "use a smaller --prefill-chunk".into(),
        Advice::ShorterRequests => "shorten the requests".into(),
    }
}

/// `e`'s message with flags instead of option fields.
pub fn kv_for_cli(e: &KvError) -> String {
    let mut s = e.to_string();
    if let KvError::BudgetExceeded { advice, .. } = e {
        let cli: Vec<String> = advice.iter().map(advice_flag).collect();
        s = s.replace(&advice_text(advice), &cli.join(", or "));
    }
    if let KvError::InvalidOption { option, .. } = e {
        if !s.contains(&format!("`{}`", option.field())) {
            // The message does not name the option: say which flag sets it.
            s.push_str(&match option {
                PolicyOption::HeadGroup => {
                    " (--head-group N; headwise:N in kvbench's --policies)".to_string()
                }
                o => format!(" ({})", o.flag()),
            });
        }
    }
    for o in PolicyOption::ALL {
        s = s.replace(&format!("`{}`", o.field()), o.flag());
    }
    s.replace("`prefill_chunk`", "--prefill-chunk")
}

/// `e` with its causes (`{e:#}`), every policy error in the chain mapped by [`kv_for_cli`].
pub fn for_cli(e: &anyhow::Error) -> String {
    let mut s = format!("{e:#}");
    for cause in e.chain() {
        let kv = match (
            cause.downcast_ref::<KvError>(),
            cause.downcast_ref::<ModelError>(),
        ) {
            (Some(kv), _) | (None, Some(ModelError::Policy(kv))) => kv,
            _ => continue,
        };
        s = s.replace(&kv.to_string(), &kv_for_cli(kv));
    }
    s
}
