//! block: Gnothi's replicated block store on Keel, served over NBD.
//!
//! - [`meta`]: the agreed metadata (version and hash per block) as a [`keel::Service`];
//! - [`local`], [`store`], [`prepare_log`]: a node's own data, PrepareData and its log;
//! - [`plane`]: PrepareData and block fetches between nodes, off the ordering path;
//! - [`front`]: the NBD server and the read and write protocols;
//! - [`nbd`]: the NBD wire format; [`geometry`]: blocks, slices, preferred nodes;
//! - [`check`]: whether a copy one node served may be used; [`executed`]: which writes of
//!   a front end's epoch executed.

pub mod check;
pub mod executed;
pub mod front;
pub mod geometry;
pub mod local;
pub mod meta;
mod meta_store;
pub mod nbd;
pub mod plane;
pub mod prepare_log;
pub mod recovery;
pub mod report;
pub mod store;
pub mod tls;

pub use geometry::Geometry;
pub use meta::BlockService;

use std::collections::BTreeMap;

/// The block service's settings, as cluster.toml's `[service_options]` holds them
/// (every node the same; `keel init --service block` writes them).
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Bytes of the export.
    pub size: u64,
    pub block_size: u64,
    pub mode: front::Mode,
    /// Share of the export a node may hold outside its preferred slices (Gnothi §3.5;
    /// default 10 %).
    pub reserve: f64,
    /// Recovery phase 2's throttle, MB/s of block data fetched (0: none).
    pub recovery_mbps: u64,
    /// Seconds of agreed time a front end may order nothing before the cluster ends its
    /// epoch and the nodes drop the PrepareData it left (`meta::EPOCH_IDLE_MS`). Part of
    /// the agreed state machine: every node reads it from cluster.toml.
    pub epoch_idle_s: u64,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            size: 1 << 30,
            block_size: 4096,
            mode: front::Mode::Gnothi,
            reserve: 0.10,
            recovery_mbps: 0,
            epoch_idle_s: meta::EPOCH_IDLE_MS / 1000,
        }
    }
}

impl Settings {
    /// Reads `[service_options]`; an unknown key or a bad value is an error, so a typo
    /// does not pass unnoticed.
    ///
    /// # Errors
    /// A message naming the key.
    pub fn from_map(options: &BTreeMap<String, String>) -> Result<Settings, String> {
        let mut s = Settings::default();
        for (key, value) in options {
            match key.as_str() {
                "size" => s.size = parse_size(value).map_err(|e| format!("service_options.size: {e}"))?,
                "block_size" => {
                    s.block_size = parse_size(value).map_err(|e| format!("service_options.block_size: {e}"))?
                }
                "mode" => {
                    s.mode = front::Mode::parse(value)
                        .ok_or_else(|| format!("service_options.mode = {value:?}: gnothi or full"))?
                }
                "reserve_pct" => {
                    let pct: f64 =
                        value.parse().map_err(|_| format!("service_options.reserve_pct = {value:?}: a percentage"))?;
                    if !(0.0..=100.0).contains(&pct) {
                        return Err(format!("service_options.reserve_pct = {pct}: 0 to 100"));
                    }
                    s.reserve = pct / 100.0;
                }
                "recovery_mbps" => {
                    s.recovery_mbps = value
                        .parse()
                        .map_err(|_| format!("service_options.recovery_mbps = {value:?}: MB/s, 0 for no throttle"))?;
                }
                "epoch_idle_s" => {
                    s.epoch_idle_s = value
                        .parse()
                        .ok()
                        .filter(|&s| s > 0)
                        .ok_or_else(|| format!("service_options.epoch_idle_s = {value:?}: seconds, at least 1"))?;
                }
                other => {
                    return Err(format!(
                        "service_options.{other}: the block service knows size, block_size, mode, reserve_pct, \
                         recovery_mbps, epoch_idle_s"
                    ))
                }
            }
        }
        Ok(s)
    }

    /// The map `keel init` writes.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("size".into(), self.size.to_string()),
            ("block_size".into(), self.block_size.to_string()),
            ("mode".into(), self.mode.name().into()),
            ("reserve_pct".into(), format!("{}", self.reserve * 100.0)),
            ("recovery_mbps".into(), self.recovery_mbps.to_string()),
            ("epoch_idle_s".into(), self.epoch_idle_s.to_string()),
        ])
    }
}

/// "8G", "64M", "512K", "1T" (powers of 1024) or plain bytes.
///
/// # Errors
/// Anything else, or an overflow.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("{s:?}: a number of bytes, or with K, M, G or T")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits.parse().map_err(|_| format!("{s:?}: a number of bytes, or with K, M, G or T"))?;
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("123"), Ok(123));
        assert!(parse_size("8X").is_err() && parse_size("").is_err() && parse_size("99999999999T").is_err());
    }

    #[test]
    fn settings_round_trip_and_typos_are_refused() {
        let s = Settings {
            mode: front::Mode::Full,
            reserve: 0.25,
            recovery_mbps: 40,
            epoch_idle_s: 5,
            ..Settings::default()
        };
        assert_eq!(Settings::from_map(&s.to_map()), Ok(s));
        let typo = BTreeMap::from([("sise".to_string(), "1G".to_string())]);
        assert!(Settings::from_map(&typo).is_err());
        let bad = BTreeMap::from([("reserve_pct".to_string(), "140".to_string())]);
        assert!(Settings::from_map(&bad).is_err());
    }
}
