//! Billing exports: per-request lines or per-day aggregates (by day and model), as CSV,
//! JSON Lines or Parquet. Aggregates and totals are sums of the ledger's integer per-request
//! values, so an export's totals equal the sum of its lines and of the requests' usage.

use std::collections::BTreeMap;
use std::sync::Arc;

use parquet::basic::{ConvertedType, LogicalType, Repetition, TimeUnit, Type as PhysicalType};
use parquet::data_type::{ByteArray, ByteArrayType, Int32Type, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::Type;
use serde::Serialize;

use crate::{day_of, format_nusd, BillingError, LedgerRow};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Csv,
    Jsonl,
    Parquet,
}

impl Format {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "csv" => Some(Self::Csv),
            "jsonl" | "ndjson" => Some(Self::Jsonl),
            "parquet" => Some(Self::Parquet),
            _ => None,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::Csv => "text/csv; charset=utf-8",
            Self::Jsonl => "application/x-ndjson",
            Self::Parquet => "application/vnd.apache.parquet",
        }
    }

    pub fn extension(self) -> &'static str {
        match self {
            Self::Csv => "csv",
            Self::Jsonl => "jsonl",
            Self::Parquet => "parquet",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    Request,
    Day,
}

impl Granularity {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "request" | "requests" => Some(Self::Request),
            "day" | "daily" => Some(Self::Day),
            _ => None,
        }
    }
}

/// Sums over a set of rows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub requests: i64,
    pub uncached_input_tokens: i64,
    pub cached_input_tokens: i64,
    pub output_tokens: i64,
    pub cost_input_nusd: i64,
    pub cost_cached_nusd: i64,
    pub cost_output_nusd: i64,
    pub processor_us: i64,
    pub cost_processor_nusd: i64,
    pub cost_nusd: i64,
}

impl Totals {
    pub fn add(&mut self, r: &LedgerRow) {
        self.requests += 1;
        self.uncached_input_tokens += i64::from(r.rec.uncached_input_tokens());
        self.cached_input_tokens += i64::from(r.rec.cached_tokens);
        self.output_tokens += i64::from(r.rec.completion_tokens);
        self.cost_input_nusd += r.cost.input_nusd;
        self.cost_cached_nusd += r.cost.cached_nusd;
        self.cost_output_nusd += r.cost.output_nusd;
        self.processor_us += i64::try_from(r.rec.processor_us).unwrap_or(i64::MAX);
        self.cost_processor_nusd += r.cost.processor_nusd;
        self.cost_nusd += r.cost.total_nusd;
    }

    pub fn of(rows: &[LedgerRow]) -> Self {
        let mut t = Self::default();
        rows.iter().for_each(|r| t.add(r));
        t
    }
}

/// One aggregate line: a day, a model and an adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DayLine {
    pub day: String,
    pub model: String,
    /// The tenant's adapter (empty: the base model).
    pub adapter: String,
    #[serde(flatten)]
    pub totals: Totals,
}

/// Per-day aggregates by model and adapter, in day, model, adapter order.
pub fn by_day(rows: &[LedgerRow]) -> Vec<DayLine> {
    let mut m: BTreeMap<(String, String, String), Totals> = BTreeMap::new();
    for r in rows {
        let adapter = r.rec.adapter.clone().unwrap_or_default();
        m.entry((day_of(r.rec.started_at), r.rec.model.clone(), adapter))
            .or_default()
            .add(r);
    }
    m.into_iter()
        .map(|((day, model, adapter), totals)| DayLine {
            day,
            model,
            adapter,
            totals,
        })
        .collect()
}

/// A column: its name and, per line, its values. Text formats write times, days and money
/// as text (ISO 8601, `YYYY-MM-DD`, decimal USD); Parquet gives them the logical types
/// analysts' tools read natively: TIMESTAMP(MILLIS, UTC), DATE and DECIMAL(18, 9).
enum Col {
    Int(&'static str, Vec<i64>),
    Str(&'static str, Vec<String>),
    /// Unix milliseconds.
    Time(&'static str, Vec<i64>),
    /// Unix milliseconds, as the UTC day they fall on.
    Day(&'static str, Vec<i64>),
    /// Nano-USD (exactly: DECIMAL with scale 9).
    Usd(&'static str, Vec<i64>),
}

/// Digits of the money columns' DECIMAL: 18 fit an INT64, so up to 999,999,999.999999999 USD.
const USD_PRECISION: i32 = 18;
const USD_SCALE: i32 = 9;

fn iso(ms: i64) -> String {
    let secs = ms.rem_euclid(86_400_000) / 1000;
    format!(
        "{}T{:02}:{:02}:{:02}.{:03}Z",
        day_of(ms),
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        ms.rem_euclid(1000)
    )
}

fn request_columns(rows: &[LedgerRow]) -> Vec<Col> {
    let s = |name, f: &dyn Fn(&LedgerRow) -> String| Col::Str(name, rows.iter().map(f).collect());
    let i = |name, f: &dyn Fn(&LedgerRow) -> i64| Col::Int(name, rows.iter().map(f).collect());
    vec![
        s("request_id", &|r| r.rec.request_id.clone()),
        Col::Time("started_at", rows.iter().map(|r| r.rec.started_at).collect()),
        Col::Day("day", rows.iter().map(|r| r.rec.started_at).collect()),
        s("tenant_id", &|r| r.rec.tenant_id.clone()),
        s("key_id", &|r| r.rec.key_id.clone().unwrap_or_default()),
        s("model", &|r| r.rec.model.clone()),
        s("adapter", &|r| r.rec.adapter.clone().unwrap_or_default()),
        s("batch_id", &|r| r.rec.batch_id.clone().unwrap_or_default()),
        s("endpoint", &|r| r.rec.endpoint.clone()),
        s("status", &|r| r.rec.status.clone()),
        s("finish_reason", &|r| r.rec.finish_reason.clone().unwrap_or_default()),
        i("uncached_input_tokens", &|r| i64::from(r.rec.uncached_input_tokens())),
        i("cached_input_tokens", &|r| i64::from(r.rec.cached_tokens)),
        i("output_tokens", &|r| i64::from(r.rec.completion_tokens)),
        i("price_effective_from", &|r| r.cost.price_effective_from.unwrap_or(-1)),
        i("cost_input_nusd", &|r| r.cost.input_nusd),
        i("cost_cached_nusd", &|r| r.cost.cached_nusd),
        i("cost_output_nusd", &|r| r.cost.output_nusd),
        i("processor_us", &|r| {
            i64::try_from(r.rec.processor_us).unwrap_or(i64::MAX)
        }),
        i("cost_processor_nusd", &|r| r.cost.processor_nusd),
        i("cost_nusd", &|r| r.cost.total_nusd),
        Col::Usd("cost_usd", rows.iter().map(|r| r.cost.total_nusd).collect()),
    ]
}

fn day_columns(lines: &[DayLine]) -> Vec<Col> {
    let s = |name, f: &dyn Fn(&DayLine) -> String| Col::Str(name, lines.iter().map(f).collect());
    let i = |name, f: &dyn Fn(&DayLine) -> i64| Col::Int(name, lines.iter().map(f).collect());
    vec![
        Col::Day(
            "day",
            lines.iter().map(|l| crate::parse_day(&l.day).unwrap_or(0)).collect(),
        ),
        s("model", &|l| l.model.clone()),
        s("adapter", &|l| l.adapter.clone()),
        i("requests", &|l| l.totals.requests),
        i("uncached_input_tokens", &|l| l.totals.uncached_input_tokens),
        i("cached_input_tokens", &|l| l.totals.cached_input_tokens),
        i("output_tokens", &|l| l.totals.output_tokens),
        i("cost_input_nusd", &|l| l.totals.cost_input_nusd),
        i("cost_cached_nusd", &|l| l.totals.cost_cached_nusd),
        i("cost_output_nusd", &|l| l.totals.cost_output_nusd),
        i("processor_us", &|l| l.totals.processor_us),
        i("cost_processor_nusd", &|l| l.totals.cost_processor_nusd),
        i("cost_nusd", &|l| l.totals.cost_nusd),
        Col::Usd("cost_usd", lines.iter().map(|l| l.totals.cost_nusd).collect()),
    ]
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn name(c: &Col) -> &'static str {
    match c {
        Col::Int(n, _) | Col::Str(n, _) | Col::Time(n, _) | Col::Day(n, _) | Col::Usd(n, _) => n,
    }
}

fn len(c: &Col) -> usize {
    match c {
        Col::Int(_, v) | Col::Time(_, v) | Col::Day(_, v) | Col::Usd(_, v) => v.len(),
        Col::Str(_, v) => v.len(),
    }
}

/// A value as the text formats write it.
fn text(c: &Col, row: usize) -> Option<String> {
    match c {
        Col::Int(..) => None,
        Col::Str(_, v) => Some(v[row].clone()),
        Col::Time(_, v) => Some(iso(v[row])),
        Col::Day(_, v) => Some(day_of(v[row])),
        Col::Usd(_, v) => Some(format_nusd(v[row])),
    }
}

fn write_csv(cols: &[Col]) -> Vec<u8> {
    let mut out = cols.iter().map(name).collect::<Vec<_>>().join(",");
    out.push('\n');
    for row in 0..cols.first().map_or(0, len) {
        let fields: Vec<String> = cols
            .iter()
            .map(|c| match (c, text(c, row)) {
                (Col::Int(_, v), _) => v[row].to_string(),
                (_, t) => csv_field(&t.unwrap_or_default()),
            })
            .collect();
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out.into_bytes()
}

fn write_jsonl(cols: &[Col]) -> Vec<u8> {
    let mut out = Vec::new();
    for row in 0..cols.first().map_or(0, len) {
        let mut o = serde_json::Map::new();
        for c in cols {
            let v = match (c, text(c, row)) {
                (Col::Int(_, v), _) => serde_json::json!(v[row]),
                (_, t) => serde_json::json!(t),
            };
            o.insert(name(c).to_string(), v);
        }
        out.extend_from_slice(serde_json::Value::Object(o).to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

fn write_parquet(cols: &[Col]) -> Result<Vec<u8>, parquet::errors::ParquetError> {
    let fields =
        cols.iter()
            .map(|c| {
                let b = match c {
                    Col::Int(n, _) => Type::primitive_type_builder(n, PhysicalType::INT64),
                    Col::Str(n, _) => Type::primitive_type_builder(n, PhysicalType::BYTE_ARRAY)
                        .with_converted_type(ConvertedType::UTF8),
                    Col::Time(n, _) => Type::primitive_type_builder(n, PhysicalType::INT64)
                        .with_logical_type(Some(LogicalType::timestamp(true, TimeUnit::MILLIS))),
                    Col::Day(n, _) => {
                        Type::primitive_type_builder(n, PhysicalType::INT32).with_logical_type(Some(LogicalType::Date))
                    }
                    Col::Usd(n, _) => Type::primitive_type_builder(n, PhysicalType::INT64)
                        .with_logical_type(Some(LogicalType::decimal(USD_SCALE, USD_PRECISION)))
                        .with_precision(USD_PRECISION)
                        .with_scale(USD_SCALE),
                };
                b.with_repetition(Repetition::REQUIRED).build().map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
    let schema = Arc::new(Type::group_type_builder("hearth_usage").with_fields(fields).build()?);
    let props = Arc::new(WriterProperties::builder().build());
    let mut buf = Vec::new();
    let mut w = SerializedFileWriter::new(&mut buf, schema, props)?;
    let mut rg = w.next_row_group()?;
    let mut i = 0;
    while let Some(mut col) = rg.next_column()? {
        match &cols[i] {
            Col::Int(_, v) | Col::Time(_, v) | Col::Usd(_, v) => {
                col.typed::<Int64Type>().write_batch(v, None, None)?;
            }
            Col::Day(_, v) => {
                let days: Vec<i32> = v
                    .iter()
                    .map(|ms| i32::try_from(ms.div_euclid(86_400_000)).unwrap_or(i32::MAX))
                    .collect();
                col.typed::<Int32Type>().write_batch(&days, None, None)?;
            }
            Col::Str(_, v) => {
                let bytes: Vec<ByteArray> = v.iter().map(|s| ByteArray::from(s.as_str())).collect();
                col.typed::<ByteArrayType>().write_batch(&bytes, None, None)?;
            }
        }
        col.close()?;
        i += 1;
    }
    rg.close()?;
    w.close()?;
    Ok(buf)
}

/// An export's bytes and its totals.
pub struct Export {
    pub bytes: Vec<u8>,
    pub totals: Totals,
    pub lines: usize,
}

/// Renders rows in a format and granularity.
pub fn render(rows: &[LedgerRow], format: Format, granularity: Granularity) -> Result<Export, BillingError> {
    let totals = Totals::of(rows);
    let (cols, lines) = match granularity {
        Granularity::Request => (request_columns(rows), rows.len()),
        Granularity::Day => {
            let d = by_day(rows);
            (day_columns(&d), d.len())
        }
    };
    let bytes = match format {
        Format::Csv => write_csv(&cols),
        Format::Jsonl => write_jsonl(&cols),
        Format::Parquet => write_parquet(&cols).map_err(|e| BillingError::Export(e.to_string()))?,
    };
    Ok(Export { bytes, totals, lines })
}
