//! What the dashboard's pages show, computed from the ledger's rows (the same rows the
//! usage API and the billing exports read): usage per time bucket and model, the cached
//! share and what it saved, latency percentiles and error counts, and the charts, drawn as
//! SVG geometry that the templates render (every label goes through the template's HTML
//! escaping).

use std::collections::BTreeMap;

use hearth_billing::export::Totals;
use hearth_billing::{format_nusd, price_of, rate, LedgerRow, Price};
use serde::Serialize;

/// A usage window and its bucket size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// The last 48 hours, by hour.
    Hours48,
    /// The last 30 days, by day.
    Days30,
}

pub const HOUR_MS: i64 = 3_600_000;
pub const DAY_MS: i64 = 86_400_000;

impl Range {
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            Some("30d") => Range::Days30,
            _ => Range::Hours48,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Range::Hours48 => "48h",
            Range::Days30 => "30d",
        }
    }

    pub fn bucket_ms(self) -> i64 {
        match self {
            Range::Hours48 => HOUR_MS,
            Range::Days30 => DAY_MS,
        }
    }

    fn buckets(self) -> i64 {
        match self {
            Range::Hours48 => 48,
            Range::Days30 => 30,
        }
    }

    /// `[from, to)` covering whole buckets, the last one holding `now`.
    pub fn window(self, now: i64) -> (i64, i64) {
        let b = self.bucket_ms();
        let to = now.div_euclid(b) * b + b;
        (to - self.buckets() * b, to)
    }

    fn label(self, start: i64) -> String {
        let day = hearth_billing::day_of(start);
        match self {
            Range::Hours48 => format!("{} {:02}:00", &day[5..], start.rem_euclid(DAY_MS) / HOUR_MS),
            Range::Days30 => day[5..].to_string(),
        }
    }
}

/// One row of the usage table: a bucket and a model.
#[derive(Debug, Clone, Serialize)]
pub struct UsageLine {
    pub bucket: String,
    pub model: String,
    pub requests: i64,
    pub uncached_input_tokens: i64,
    pub cached_input_tokens: i64,
    pub output_tokens: i64,
    pub cost_usd: String,
}

/// The window's totals as shown.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub requests: i64,
    pub input_tokens: i64,
    pub uncached_input_tokens: i64,
    pub cached_input_tokens: i64,
    pub output_tokens: i64,
    pub cost_usd: String,
    /// Cached input tokens ÷ input tokens, as a percentage with one decimal.
    pub cached_share: String,
    /// What the cached tokens would have cost at the uncached input price, less what they
    /// cost at the cached price.
    pub saved_usd: String,
    pub failed: i64,
    pub cancelled: i64,
}

/// Latency and errors of one model in the window.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyLine {
    pub model: String,
    pub requests: usize,
    pub ttft_p50: String,
    pub ttft_p90: String,
    pub ttft_p99: String,
    pub e2e_p50: String,
    pub e2e_p90: String,
    pub e2e_p99: String,
    pub failed: usize,
    pub cancelled: usize,
}

/// A stacked bar chart's geometry.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Chart {
    pub width: u32,
    pub height: u32,
    pub bars: Vec<Bar>,
    pub x_labels: Vec<Label>,
    pub y_labels: Vec<Label>,
    pub legend: Vec<Legend>,
    pub grid: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Bar {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
    /// A series index: the stylesheet colours `.s0` … `.s7`.
    pub series: usize,
    pub title: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Label {
    pub x: f64,
    pub y: f64,
    pub text: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Legend {
    pub series: usize,
    pub text: String,
}

/// Everything the usage page needs.
#[derive(Debug, Clone, Serialize)]
pub struct UsageView {
    pub range: &'static str,
    pub summary: Summary,
    pub lines: Vec<UsageLine>,
    pub latency: Vec<LatencyLine>,
    pub tokens_chart: Chart,
    pub cost_chart: Chart,
}

/// Nano-USD the cached tokens of `r` saved, at the price it was rated with.
fn saved_nusd(r: &LedgerRow, prices: &[Price]) -> i64 {
    if r.rec.cached_tokens == 0 || r.cost.price_effective_from.is_none() {
        return 0;
    }
    let Some(p) = price_of(prices, &r.rec) else {
        return 0;
    };
    let mut uncached = r.rec.clone();
    uncached.cached_tokens = 0;
    let full = rate(&uncached, Some(p)).input_nusd;
    (full - r.cost.input_nusd - r.cost.cached_nusd).max(0)
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

fn ms(v: Option<i64>) -> String {
    v.map_or_else(|| "–".to_string(), |v| format!("{v} ms"))
}

fn pct(part: i64, whole: i64) -> String {
    if whole == 0 {
        "0.0 %".into()
    } else {
        format!("{:.1} %", part as f64 * 100.0 / whole as f64)
    }
}

/// The usage page's data for `rows` (one tenant's, inside the range's window).
pub fn usage_view(rows: &[LedgerRow], prices: &[Price], range: Range, now: i64) -> UsageView {
    let (from, _) = range.window(now);
    let b = range.bucket_ms();
    let n = range.buckets() as usize;
    let totals = Totals::of(rows);
    let mut per: BTreeMap<(i64, String), Totals> = BTreeMap::new();
    let mut models: Vec<String> = Vec::new();
    let mut saved = 0;
    let (mut failed, mut cancelled) = (0, 0);
    for r in rows {
        let bucket = (r.rec.started_at - from).div_euclid(b);
        per.entry((bucket, r.rec.model.clone())).or_default().add(r);
        if !models.contains(&r.rec.model) {
            models.push(r.rec.model.clone());
        }
        saved += saved_nusd(r, prices);
        match r.rec.status.as_str() {
            "failed" => failed += 1,
            "cancelled" => cancelled += 1,
            _ => {}
        }
    }
    models.sort();
    let input = totals.uncached_input_tokens + totals.cached_input_tokens;
    let summary = Summary {
        requests: totals.requests,
        input_tokens: input,
        uncached_input_tokens: totals.uncached_input_tokens,
        cached_input_tokens: totals.cached_input_tokens,
        output_tokens: totals.output_tokens,
        cost_usd: format_nusd(totals.cost_nusd),
        cached_share: pct(totals.cached_input_tokens, input),
        saved_usd: format_nusd(saved),
        failed,
        cancelled,
    };
    let lines = per
        .iter()
        .rev()
        .map(|((bucket, model), t)| UsageLine {
            bucket: range.label(from + bucket * b),
            model: model.clone(),
            requests: t.requests,
            uncached_input_tokens: t.uncached_input_tokens,
            cached_input_tokens: t.cached_input_tokens,
            output_tokens: t.output_tokens,
            cost_usd: format_nusd(t.cost_nusd),
        })
        .collect();
    // Tokens by class per bucket; cost by model per bucket.
    let mut tokens = vec![[0f64; 3]; n];
    let mut cost = vec![vec![0f64; models.len()]; n];
    for ((bucket, model), t) in &per {
        let Ok(i) = usize::try_from(*bucket) else { continue };
        if i >= n {
            continue;
        }
        tokens[i][0] += t.uncached_input_tokens as f64;
        tokens[i][1] += t.cached_input_tokens as f64;
        tokens[i][2] += t.output_tokens as f64;
        if let Some(m) = models.iter().position(|x| x == model) {
            cost[i][m] += t.cost_nusd as f64 / 1e9;
        }
    }
    let labels: Vec<String> = (0..n).map(|i| range.label(from + i as i64 * b)).collect();
    let tokens_chart = stacked(
        &labels,
        &tokens.iter().map(|t| t.to_vec()).collect::<Vec<_>>(),
        &["uncached input", "cached input", "output"].map(String::from),
        &|v| format!("{v:.0} tokens"),
    );
    let cost_chart = stacked(&labels, &cost, &models, &|v| format!("${v:.6}"));
    UsageView {
        range: range.as_str(),
        summary,
        lines,
        latency: latency(rows),
        tokens_chart,
        cost_chart,
    }
}

/// TTFT (gateway arrival → first token) and end-to-end percentiles per model, from the
/// rows that record them; failed and cancelled counts.
pub fn latency(rows: &[LedgerRow]) -> Vec<LatencyLine> {
    let mut by: BTreeMap<&str, Vec<&LedgerRow>> = BTreeMap::new();
    for r in rows {
        by.entry(r.rec.model.as_str()).or_default().push(r);
    }
    by.into_iter()
        .map(|(model, rs)| {
            let mut ttft: Vec<i64> = rs.iter().filter_map(|r| r.rec.ttft_ms.map(i64::from)).collect();
            let mut e2e: Vec<i64> = rs
                .iter()
                .filter(|r| r.rec.status == "completed")
                .map(|r| r.rec.finished_at - r.rec.started_at)
                .collect();
            ttft.sort_unstable();
            e2e.sort_unstable();
            LatencyLine {
                model: if model.is_empty() {
                    "(none)".into()
                } else {
                    model.to_string()
                },
                requests: rs.len(),
                ttft_p50: ms(percentile(&ttft, 50.0)),
                ttft_p90: ms(percentile(&ttft, 90.0)),
                ttft_p99: ms(percentile(&ttft, 99.0)),
                e2e_p50: ms(percentile(&e2e, 50.0)),
                e2e_p90: ms(percentile(&e2e, 90.0)),
                e2e_p99: ms(percentile(&e2e, 99.0)),
                failed: rs.iter().filter(|r| r.rec.status == "failed").count(),
                cancelled: rs.iter().filter(|r| r.rec.status == "cancelled").count(),
            }
        })
        .collect()
}

const CHART_W: f64 = 720.0;
const CHART_H: f64 = 200.0;
const LEFT: f64 = 64.0;
const BOTTOM: f64 = 24.0;
const TOP: f64 = 8.0;

/// A stacked bar chart: one bar per label, one segment per series.
fn stacked(labels: &[String], values: &[Vec<f64>], series: &[String], fmt: &dyn Fn(f64) -> String) -> Chart {
    let n = labels.len().max(1);
    let max = values.iter().map(|v| v.iter().sum::<f64>()).fold(0.0, f64::max);
    let top = nice_ceiling(max);
    let plot_w = CHART_W - LEFT - 8.0;
    let plot_h = CHART_H - TOP - BOTTOM;
    let slot = plot_w / n as f64;
    let w = (slot * 0.8).max(1.0);
    let mut bars = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let mut y = TOP + plot_h;
        for (s, value) in v.iter().enumerate() {
            if *value <= 0.0 {
                continue;
            }
            let h = value / top * plot_h;
            y -= h;
            bars.push(Bar {
                x: round(LEFT + i as f64 * slot + (slot - w) / 2.0),
                y: round(y),
                w: round(w),
                h: round(h.max(0.5)),
                series: s % 8,
                title: format!(
                    "{} · {}: {}",
                    labels[i],
                    series.get(s).map_or("", String::as_str),
                    fmt(*value)
                ),
            });
        }
    }
    let every = n.div_ceil(8);
    let x_labels = labels
        .iter()
        .enumerate()
        .filter(|(i, _)| i % every == 0)
        .map(|(i, l)| Label {
            x: round(LEFT + i as f64 * slot + slot / 2.0),
            y: CHART_H - 6.0,
            text: l.clone(),
        })
        .collect();
    let mut y_labels = Vec::new();
    let mut grid = Vec::new();
    for k in 0..=4 {
        let v = top * k as f64 / 4.0;
        let y = round(TOP + plot_h - plot_h * k as f64 / 4.0);
        grid.push(y);
        y_labels.push(Label {
            x: LEFT - 6.0,
            y: y + 4.0,
            text: short(v),
        });
    }
    Chart {
        width: CHART_W as u32,
        height: CHART_H as u32,
        bars,
        x_labels,
        y_labels,
        legend: series
            .iter()
            .enumerate()
            .map(|(i, s)| Legend {
                series: i % 8,
                text: s.clone(),
            })
            .collect(),
        grid,
    }
}

fn round(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// 1, 2 or 5 × a power of ten, at least `v` (1 for an empty chart).
fn nice_ceiling(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * p)
}

fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if v >= 1.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_billing::{Cost, PriceRates, UsageRecord};

    fn row(model: &str, at: i64, prompt: u32, cached: u32, out: u32, status: &str, ttft: Option<u32>) -> LedgerRow {
        let mut rec = UsageRecord::started("r", "t", None, "/v1/chat/completions", at);
        rec.model = model.into();
        rec.prompt_tokens = prompt;
        rec.cached_tokens = cached;
        rec.completion_tokens = out;
        rec.status = status.into();
        rec.finished_at = at + 100;
        rec.ttft_ms = ttft;
        let price = price();
        let cost = rate(&rec, Some(&price));
        LedgerRow { rec, cost }
    }

    fn price() -> Price {
        Price {
            model: "*".into(),
            effective_from: 0,
            rates: PriceRates {
                input_micros_per_mtok: 1_000_000,
                cached_input_micros_per_mtok: 250_000,
                output_micros_per_mtok: 2_000_000,
                processor_micros_per_cpu_s: 0,
                batch_percent: hearth_billing::DEFAULT_BATCH_PERCENT,
            },
            created_at: 0,
        }
    }

    #[test]
    fn totals_savings_and_percentiles_match_the_rows() {
        let now = 10 * DAY_MS + 5 * HOUR_MS;
        let rows = vec![
            row("a", now - HOUR_MS, 100, 60, 10, "completed", Some(20)),
            row("a", now - 2 * HOUR_MS, 50, 0, 5, "completed", Some(40)),
            row("b", now - 3 * HOUR_MS, 10, 0, 0, "failed", None),
        ];
        let v = usage_view(&rows, &[price()], Range::Hours48, now);
        assert_eq!(v.summary.requests, 3);
        assert_eq!(v.summary.input_tokens, 160);
        assert_eq!(v.summary.cached_input_tokens, 60);
        assert_eq!(v.summary.output_tokens, 15);
        assert_eq!(v.summary.cached_share, "37.5 %");
        // 60 cached tokens at $1/M instead of $0.25/M: 60 × 0.75 µUSD = 45 µUSD.
        assert_eq!(v.summary.saved_usd, format_nusd(45_000));
        let cost: i64 = rows.iter().map(|r| r.cost.total_nusd).sum();
        assert_eq!(v.summary.cost_usd, format_nusd(cost));
        assert_eq!(v.summary.failed, 1);
        assert_eq!(v.lines.len(), 3);
        let a = &v.latency[0];
        assert_eq!(
            (a.model.as_str(), a.ttft_p50.as_str(), a.ttft_p99.as_str()),
            ("a", "20 ms", "40 ms")
        );
        assert_eq!(a.e2e_p50, "100 ms");
        assert_eq!(v.latency[1].failed, 1);
        // One bar segment per non-zero class of each bucket with traffic.
        assert_eq!(v.tokens_chart.bars.len(), 3 + 2 + 1);
        assert_eq!(v.cost_chart.legend.len(), 2);
        let _ = Cost::default();
    }

    #[test]
    fn windows_cover_whole_buckets_ending_after_now() {
        let now = 3 * DAY_MS + 90 * 60_000;
        let (from, to) = Range::Hours48.window(now);
        assert_eq!(to, 3 * DAY_MS + 2 * HOUR_MS);
        assert_eq!(to - from, 48 * HOUR_MS);
        let (from, to) = Range::Days30.window(now);
        assert_eq!((to, to - from), (4 * DAY_MS, 30 * DAY_MS));
        assert_eq!(percentile(&[1, 2, 3, 4], 50.0), Some(2));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(nice_ceiling(730.0), 1000.0);
        assert_eq!(nice_ceiling(0.0), 1.0);
    }
}
