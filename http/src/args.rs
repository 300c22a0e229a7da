//! The flags both servers take, as one clap struct each server's `Config` flattens. The servers
//! differ only in the environment names (`SPADE_GATEWAY_PORT`, `SPADE_VERIFIER_PORT`, ...) and two
//! defaults, which a [`ServerProfile`] supplies (made with [`server_profile!`]).

use std::fmt::Debug;
use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr};

use clap::{Args, Subcommand};

/// Environment names and defaults of one server's shared flags.
pub trait ServerProfile: Clone + Debug + Send + Sync + 'static {
    const ENV: EnvNames;
    const PORT: &'static str;
    const MAX_BODY_BYTES: &'static str;
}

/// The environment variable of each shared flag.
#[derive(Debug, Clone, Copy)]
pub struct EnvNames {
    pub host: &'static str,
    pub port: &'static str,
    pub api_key: &'static str,
    pub max_body_bytes: &'static str,
    pub log: &'static str,
    pub log_json: &'static str,
    pub metrics_public: &'static str,
}

/// `server_profile!(Name, "SPADE_X", port = "8080", max_body_bytes = "4194304")` defines the profile
/// `Name`, whose flags read `SPADE_X_HOST`, `SPADE_X_PORT`, `SPADE_X_API_KEY`, `SPADE_X_MAX_BODY_BYTES`,
/// `SPADE_X_LOG`, `SPADE_X_LOG_JSON` and `SPADE_X_METRICS_PUBLIC`.
#[macro_export]
macro_rules! server_profile {
    ($name:ident, $prefix:literal, port = $port:literal, max_body_bytes = $body:literal) => {
        #[derive(Debug, Clone)]
        pub struct $name;

        impl $crate::ServerProfile for $name {
            const ENV: $crate::EnvNames = $crate::EnvNames {
                host: concat!($prefix, "_HOST"),
                port: concat!($prefix, "_PORT"),
                api_key: concat!($prefix, "_API_KEY"),
                max_body_bytes: concat!($prefix, "_MAX_BODY_BYTES"),
                log: concat!($prefix, "_LOG"),
                log_json: concat!($prefix, "_LOG_JSON"),
                metrics_public: concat!($prefix, "_METRICS_PUBLIC"),
            };
            const PORT: &'static str = $port;
            const MAX_BODY_BYTES: &'static str = $body;
        }
    };
}

#[derive(Debug, Clone, Args)]
pub struct ServerArgs<P: ServerProfile> {
    /// Address to bind. The default keeps the server private to this machine.
    #[arg(long, env = P::ENV.host, default_value = "127.0.0.1")]
    pub host: IpAddr,

    #[arg(long, env = P::ENV.port, default_value = P::PORT)]
    pub port: u16,

    /// Bearer token every route except the probes (/health, /health/live, /health/ready) requires.
    #[arg(long, env = P::ENV.api_key, hide_env_values = true)]
    pub api_key: Option<String>,

    /// Serve /metrics without the API key, for Prometheus scrapers (they rarely carry one). The
    /// metrics hold counts and timings, no prompts or keys.
    #[arg(long, env = P::ENV.metrics_public)]
    pub metrics_public: bool,

    /// Largest accepted request body, in bytes.
    #[arg(long, env = P::ENV.max_body_bytes, default_value = P::MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// Log filter (tracing-subscriber syntax), e.g. `info` or `spade_gateway=debug`.
    #[arg(long, env = P::ENV.log, default_value = "info")]
    pub log: String,

    /// Log as JSON lines.
    #[arg(long, env = P::ENV.log_json)]
    pub log_json: bool,

    #[arg(skip)]
    profile: PhantomData<P>,
}

impl<P: ServerProfile> ServerArgs<P> {
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.host, self.port)
    }

    /// The API key, where one is set (an empty one is none).
    pub fn api_key(&self) -> Option<&str> {
        self.api_key.as_deref().filter(|k| !k.is_empty())
    }

    pub fn http(&self) -> HttpSettings {
        HttpSettings {
            api_key: self.api_key().map(str::to_string),
            max_body_bytes: self.max_body_bytes,
            metrics_public: self.metrics_public,
        }
    }
}

/// What the kit's layers need at request time.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// `/metrics` without the API key.
    pub metrics_public: bool,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print the OpenAPI document and exit.
    Openapi,
}
