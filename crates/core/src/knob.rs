//! What a user sets, as errors and advice name it: a shared [`PolicyOption`] or a key of a
//! policy's own settings ([`Knob`]). Front ends spell them their own way (the CLI's flags);
//! the library names options by their [`PolicyOptions`](crate::PolicyOptions) field.

/// A [`PolicyOptions`](crate::PolicyOptions) field that only some policies read;
/// [`PolicyRegistry::reads`](crate::PolicyRegistry::reads) says which a policy reads, so
/// that a front end can say when an option does not apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyOption {
    /// `device_kv_budget`.
    DeviceKvBudget,
    /// `profile`.
    Profile,
    /// `link_bandwidth`.
    LinkBandwidth,
    /// `host_kv_budget`.
    HostKvBudget,
    /// `disk_dir`.
    DiskDir,
    /// `host_kv_dtype`.
    HostKvDtype,
    /// `kv_dtype`.
    KvDtype,
}

impl PolicyOption {
    /// Every option.
    pub const ALL: [Self; 7] = [
        Self::DeviceKvBudget,
        Self::Profile,
        Self::LinkBandwidth,
        Self::HostKvBudget,
        Self::DiskDir,
        Self::HostKvDtype,
        Self::KvDtype,
    ];

    /// Its field in [`PolicyOptions`](crate::PolicyOptions), e.g. `device_kv_budget` (how
    /// library messages name it).
    pub fn field(self) -> &'static str {
        match self {
            Self::DeviceKvBudget => "device_kv_budget",
            Self::Profile => "profile",
            Self::LinkBandwidth => "link_bandwidth",
            Self::HostKvBudget => "host_kv_budget",
            Self::DiskDir => "disk_dir",
            Self::HostKvDtype => "host_kv_dtype",
            Self::KvDtype => "kv_dtype",
        }
    }
}

/// Something a user sets: one of the shared options or a key of the policy's own settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Knob {
    /// A shared option.
    Option(PolicyOption),
    /// A setting of the policy, by key (`group`, `split`, `block_size`).
    Setting(&'static str),
}

impl std::fmt::Display for Knob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Option(o) => write!(f, "`{}`", o.field()),
            Self::Setting(k) => write!(f, "`{k}`"),
        }
    }
}

impl From<PolicyOption> for Knob {
    fn from(o: PolicyOption) -> Self {
        Self::Option(o)
    }
}
