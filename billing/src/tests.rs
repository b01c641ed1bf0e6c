//! Ledger tests; each runs on SQLite and, when `DATABASE_URL` names one, on PostgreSQL.

use hearth_tenants::db::testing;

use super::export::{render, Format, Granularity, Totals};
use super::*;

async fn tenant(db: &Db, id: &str) {
    sqlx::query("INSERT INTO tenants (id, name, created_at) VALUES ($1, $1, 0)")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
}

fn rec(id: &str, tenant: &str, model: &str, prompt: u32, cached: u32, completion: u32, at: i64) -> UsageRecord {
    UsageRecord {
        request_id: id.into(),
        tenant_id: tenant.into(),
        key_id: Some("k".into()),
        model: model.into(),
        endpoint: "/v1/chat/completions".into(),
        prompt_tokens: prompt,
        cached_tokens: cached,
        completion_tokens: completion,
        status: UsageStatus::Completed.as_str().into(),
        finish_reason: Some("stop".into()),
        error_code: None,
        started_at: at,
        finished_at: at + 5,
        processor_us: 0,
        ttft_ms: Some(3),
        adapter: None,
        batch_id: None,
    }
}

fn rates(input: &str, cached: &str, output: &str) -> PriceRates {
    PriceRates {
        input_micros_per_mtok: parse_usd_micros(input).unwrap(),
        cached_input_micros_per_mtok: parse_usd_micros(cached).unwrap(),
        output_micros_per_mtok: parse_usd_micros(output).unwrap(),
        processor_micros_per_cpu_s: 0,
        batch_percent: crate::DEFAULT_BATCH_PERCENT,
    }
}

/// Processor time is its own price class: µs × USD per CPU-second, rounded once.
#[test]
fn processor_time_is_rated() {
    let price = Price {
        model: "*".into(),
        effective_from: 0,
        rates: PriceRates {
            processor_micros_per_cpu_s: parse_usd_micros("0.02").unwrap(),
            ..rates("1", "0.1", "2")
        },
        created_at: 0,
    };
    let mut r = rec("p1", "t", "m", 10, 0, 5, 0);
    r.processor_us = 1_500; // 1.5 ms of guest time at $0.02 per CPU-second: $0.00003
    let c = rate(&r, Some(&price));
    assert_eq!(c.processor_nusd, 30_000);
    assert_eq!(c.total_nusd, c.input_nusd + c.output_nusd + 30_000);
}

/// A batch's line pays the price's `batch_percent` of every class; other requests pay it whole.
#[tokio::test]
async fn batch_lines_pay_their_share() {
    let price = Price {
        model: "*".into(),
        effective_from: 0,
        rates: rates("1", "0.5", "2"),
        created_at: 0,
    };
    let plain = rec("b0", "t", "m", 1000, 200, 100, 0);
    let mut line = plain.clone();
    line.batch_id = Some("batch_1".into());
    let (full, half) = (rate(&plain, Some(&price)), rate(&line, Some(&price)));
    assert_eq!(full.total_nusd, 800_000 + 100_000 + 200_000);
    assert_eq!(half.total_nusd, full.total_nusd / 2);
    let whole = Price {
        rates: PriceRates {
            batch_percent: 100,
            ..rates("1", "0.5", "2")
        },
        ..price
    };
    assert_eq!(rate(&line, Some(&whole)).total_nusd, full.total_nusd);
    // Stored and read back with the row; a share outside 0–100 is refused.
    for db in testing::all().await {
        tenant(&db, "tn_1").await;
        let l = UsageLedger::new(&db);
        l.set_price(
            "m",
            PriceRates {
                batch_percent: 25,
                ..rates("1", "0.5", "2")
            },
            None,
        )
        .await
        .unwrap();
        assert_eq!(l.latest_rates("m").await.unwrap().unwrap().batch_percent, 25);
        assert!(l
            .set_price(
                "n",
                PriceRates {
                    batch_percent: 101,
                    ..rates("1", "0.5", "2")
                },
                None
            )
            .await
            .is_err());
        let mut u = rec("req_b", "tn_1", "m", 1000, 200, 100, now_ms());
        u.batch_id = Some("batch_1".into());
        let r = l.record(&u).await.unwrap();
        assert_eq!(r.cost.total_nusd, (800_000 + 100_000 + 200_000) / 4);
        let rows = l.rows("tn_1", 0, i64::MAX).await.unwrap();
        assert_eq!(rows[0].rec.batch_id.as_deref(), Some("batch_1"));
    }
}

#[tokio::test]
async fn records_are_idempotent_rated_and_counted() {
    for db in testing::all().await {
        tenant(&db, "tn_1").await;
        let l = UsageLedger::new(&db);
        // $1/M input, $0.25/M cached input, $2/M output.
        l.set_price("m", rates("1", "0.25", "2"), None).await.unwrap();
        let now = now_ms();
        let mut u = rec("req_1", "tn_1", "m", 1000, 400, 100, now);
        let r = l.record(&u).await.unwrap();
        assert!(r.inserted);
        // 600 uncached × $1/M = 600_000 nUSD; 400 cached × $0.25/M = 100_000; 100 × $2/M = 200_000.
        assert_eq!(
            (
                r.cost.input_nusd,
                r.cost.cached_nusd,
                r.cost.output_nusd,
                r.cost.total_nusd
            ),
            (600_000, 100_000, 200_000, 900_000),
            "{}",
            db.backend.as_str()
        );
        u.completion_tokens = 999;
        assert!(!l.record(&u).await.unwrap().inserted, "a replay must not write");
        let rows = l.recent(Some("tn_1"), 10).await.unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].rec.completion_tokens, 100);
        assert_eq!(rows[0].cost.total_nusd, 900_000);
        assert!(l.recent(Some("other"), 10).await.unwrap().is_empty());
        // The replay did not count twice.
        assert_eq!(l.month_spend("tn_1", &month_of(now)).await.unwrap(), 900_000);
        // Many concurrent records: one group commit each batch, all durable, spend exact.
        let mut tasks = Vec::new();
        for i in 0..300 {
            let l = l.clone();
            tasks.push(tokio::spawn(async move {
                l.record(&rec(&format!("req_c{i}"), "tn_1", "m", 10, 0, 10, now))
                    .await
                    .unwrap()
            }));
        }
        for t in tasks {
            assert!(t.await.unwrap().inserted);
        }
        // 10 × $1/M + 10 × $2/M = 30_000 nUSD each.
        assert_eq!(
            l.month_spend("tn_1", &month_of(now)).await.unwrap(),
            900_000 + 300 * 30_000
        );
    }
}

#[tokio::test]
async fn price_changes_keep_history() {
    for db in testing::all().await {
        tenant(&db, "tn_p").await;
        let l = UsageLedger::new(&db);
        let first = l.set_price("m", rates("1", "0.5", "2"), None).await.unwrap();
        assert_eq!(first.effective_from, 0, "a first price covers all time");
        let t0 = now_ms();
        l.record(&rec("old", "tn_p", "m", 1000, 0, 0, t0)).await.unwrap();
        // A change takes effect now (or later), never in the past.
        assert!(matches!(
            l.set_price("m", rates("9", "9", "9"), Some(t0 - 60_000)).await,
            Err(BillingError::Invalid {
                field: "effective_from",
                ..
            })
        ));
        let second = l.set_price("m", rates("3", "1", "6"), Some(t0 + 10)).await.unwrap();
        // The newest version of exactly this model is what a new one inherits from.
        assert_eq!(l.latest_rates("m").await.unwrap(), Some(second.rates));
        assert_eq!(l.latest_rates("other").await.unwrap(), None);
        l.record(&rec("new", "tn_p", "m", 1000, 0, 0, t0 + 20)).await.unwrap();
        // A late record of a request that started before the change gets the old price.
        l.record(&rec("late", "tn_p", "m", 1000, 0, 0, t0 + 5)).await.unwrap();
        let rows = l.rows("tn_p", 0, i64::MAX).await.unwrap();
        let cost = |id: &str| rows.iter().find(|r| r.rec.request_id == id).unwrap().cost;
        assert_eq!(cost("old").input_nusd, 1_000_000);
        assert_eq!(cost("late").input_nusd, 1_000_000);
        assert_eq!(cost("new").input_nusd, 3_000_000);
        assert_eq!(cost("new").price_effective_from, Some(second.effective_from));
        assert_eq!(l.prices(Some("m")).await.unwrap().len(), 2, "both versions are kept");
        // The default price applies to models without one.
        l.set_price("*", rates("0.1", "0.1", "0.1"), None).await.unwrap();
        let r = l
            .record(&rec("other", "tn_p", "unpriced", 10_000, 0, 0, t0))
            .await
            .unwrap();
        assert_eq!(r.cost.total_nusd, 1_000_000);
    }
}

fn csv_sum(bytes: &[u8], column: &str) -> i64 {
    let text = std::str::from_utf8(bytes).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let idx = header.iter().position(|h| *h == column).unwrap();
    lines
        .map(|l| l.split(',').nth(idx).unwrap().parse::<i64>().unwrap())
        .sum()
}

fn jsonl_sum(bytes: &[u8], column: &str) -> i64 {
    std::str::from_utf8(bytes)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()[column]
                .as_i64()
                .unwrap()
        })
        .sum()
}

fn parquet_sum(bytes: &[u8], column: &str) -> (i64, usize) {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let path = std::env::temp_dir().join(format!("hearth-export-{}-{column}.parquet", now_ms()));
    std::fs::write(&path, bytes).unwrap();
    let reader = SerializedFileReader::new(std::fs::File::open(&path).unwrap()).unwrap();
    let schema = reader.metadata().file_metadata().schema_descr();
    let idx = (0..schema.num_columns())
        .position(|i| schema.column(i).name() == column)
        .unwrap();
    let mut sum = 0;
    let mut n = 0;
    for row in reader.get_row_iter(None).unwrap() {
        let row = row.unwrap();
        sum += parquet::record::RowAccessor::get_long(&row, idx).unwrap();
        n += 1;
    }
    std::fs::remove_file(&path).ok();
    (sum, n)
}

#[tokio::test]
async fn exports_reconcile_in_every_format() {
    for db in testing::all().await {
        tenant(&db, "tn_e").await;
        let l = UsageLedger::new(&db);
        l.set_price("a", rates("0.15", "0.075", "0.6"), None).await.unwrap();
        l.set_price("b", rates("1.1", "0.55", "4.4"), None).await.unwrap();
        let day = 86_400_000;
        let base = parse_day("2026-11-01").unwrap();
        let mut expected = Totals::default();
        for i in 0..50u32 {
            let r = rec(
                &format!("r{i}"),
                "tn_e",
                if i % 3 == 0 { "b" } else { "a" },
                100 + i * 7,
                (i % 4) * 16,
                1 + i * 3,
                base + i64::from(i % 5) * day + i64::from(i) * 1000,
            );
            let got = l.record(&r).await.unwrap();
            expected.add(&LedgerRow { rec: r, cost: got.cost });
        }
        let rows = l.rows("tn_e", base, base + 30 * day).await.unwrap();
        assert_eq!(Totals::of(&rows), expected);
        for g in [Granularity::Request, Granularity::Day] {
            for f in [Format::Csv, Format::Jsonl, Format::Parquet] {
                let e = render(&rows, f, g).unwrap();
                assert_eq!(e.totals, expected);
                for (col, want) in [
                    ("cost_nusd", expected.cost_nusd),
                    ("cached_input_tokens", expected.cached_input_tokens),
                    ("output_tokens", expected.output_tokens),
                    ("uncached_input_tokens", expected.uncached_input_tokens),
                ] {
                    let got = match f {
                        Format::Csv => csv_sum(&e.bytes, col),
                        Format::Jsonl => jsonl_sum(&e.bytes, col),
                        Format::Parquet => {
                            let (s, n) = parquet_sum(&e.bytes, col);
                            assert_eq!(n, e.lines);
                            s
                        }
                    };
                    assert_eq!(got, want, "{f:?} {g:?} {col}");
                }
                if g == Granularity::Day {
                    assert_eq!(e.lines, 10, "5 days × 2 models");
                }
            }
        }
        // A window: only the first day.
        let first = l.rows("tn_e", base, base + day).await.unwrap();
        assert_eq!(first.len(), 10);
        assert!(first.iter().all(|r| r.rec.ttft_ms == Some(3)), "ttft round-trips");
        parquet_types_are_native(&rows);
    }
}

/// The Parquet export's times, days and money have the logical types DuckDB, pandas and
/// Spark read natively (TIMESTAMP, DATE, DECIMAL), and their values are exact.
fn parquet_types_are_native(rows: &[LedgerRow]) {
    use parquet::basic::{LogicalType, TimeUnit};
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    for g in [Granularity::Request, Granularity::Day] {
        let e = render(rows, Format::Parquet, g).unwrap();
        let path = std::env::temp_dir().join(format!("hearth-types-{}-{g:?}.parquet", now_ms()));
        std::fs::write(&path, &e.bytes).unwrap();
        let reader = SerializedFileReader::new(std::fs::File::open(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).ok();
        let schema = reader.metadata().file_metadata().schema_descr();
        let col = |name: &str| (0..schema.num_columns()).find(|i| schema.column(*i).name() == name);
        let logical = |name: &str| schema.column(col(name).unwrap()).logical_type_ref().cloned();
        assert_eq!(logical("day"), Some(LogicalType::Date), "{g:?}");
        assert_eq!(logical("cost_usd"), Some(LogicalType::decimal(9, 18)), "{g:?}");
        if g == Granularity::Request {
            assert_eq!(
                logical("started_at"),
                Some(LogicalType::timestamp(true, TimeUnit::MILLIS))
            );
        }
        let first = reader.get_row_iter(None).unwrap().next().unwrap().unwrap();
        let field = |name: &str| {
            first
                .get_column_iter()
                .find(|(n, _)| n.as_str() == name)
                .map(|(_, f)| f.clone())
                .unwrap()
        };
        let want_day = rows[0].rec.started_at.div_euclid(86_400_000);
        assert_eq!(field("day"), Field::Date(want_day as i32), "{g:?}");
        if g == Granularity::Request {
            assert_eq!(field("started_at"), Field::TimestampMillis(rows[0].rec.started_at));
            let Field::Decimal(d) = field("cost_usd") else {
                panic!("cost_usd is a decimal")
            };
            assert_eq!((d.precision(), d.scale()), (18, 9));
            assert_eq!(
                i64::from_be_bytes(d.data().try_into().unwrap()),
                rows[0].cost.total_nusd
            );
        }
    }
}

/// A process that dies with records in its outbox (not yet in the database) loses none:
/// the next process on the same directory replays them, once, idempotently.
#[test]
fn outbox_records_of_a_dead_process_are_replayed() {
    let dir = std::env::temp_dir().join(format!("hearth-outbox-{}-{}", std::process::id(), now_ms()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("ledger.db").display());
    // The first "process": its own runtime, dropped (killed) with records still pending.
    {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let db = hearth_tenants::db::open(&url, None).await.unwrap();
            tenant(&db, "tn_o").await;
            let l = UsageLedger::with_outbox(&db, &dir).await.unwrap();
            // One record committed normally…
            l.record(&rec("committed", "tn_o", "m", 5, 0, 5, now_ms()))
                .await
                .unwrap();
            // …then the database goes away: the next ones are durable in the outbox only.
            db.pool.close().await;
            for i in 0..3 {
                let p = l
                    .record_durable(&rec(&format!("pending{i}"), "tn_o", "m", 5, 0, 5, now_ms()))
                    .await;
                assert!(p.is_ok(), "appending to the outbox must succeed");
            }
        });
        rt.shutdown_timeout(std::time::Duration::from_millis(100));
    }
    let segments = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("usage-outbox-")
        })
        .count();
    assert!(segments >= 1, "the dead process's segment must still be there");
    // The next "process".
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let db = hearth_tenants::db::open(&url, None).await.unwrap();
        let l = UsageLedger::with_outbox(&db, &dir).await.unwrap();
        let rows = l.recent(Some("tn_o"), 10).await.unwrap();
        let mut ids: Vec<&str> = rows.iter().map(|r| r.rec.request_id.as_str()).collect();
        ids.sort();
        assert_eq!(ids, ["committed", "pending0", "pending1", "pending2"]);
        // Replaying again changes nothing; the spend counted each record once.
        assert_eq!(l.recover_dir(&dir).await.unwrap(), 0);
        let n: i64 = sqlx::query_scalar("SELECT requests FROM tenant_spend WHERE tenant_id = 'tn_o'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(n, 4);
        // New records go through the outbox and are committed; no segment is left over
        // beyond the current one.
        l.record(&rec("later", "tn_o", "m", 5, 0, 5, now_ms())).await.unwrap();
        let left = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("usage-outbox-")
            })
            .count();
        assert_eq!(left, 1, "only this process's current segment remains");
    });
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn money_and_dates() {
    assert_eq!(parse_usd_micros("0.15"), Some(150_000));
    assert_eq!(parse_usd_micros("$2"), Some(2_000_000));
    assert_eq!(parse_usd_micros(".5"), Some(500_000));
    assert_eq!(parse_usd_micros("1.0000001"), None);
    assert_eq!(parse_usd_micros("-1"), None);
    assert_eq!(parse_usd_micros("abc"), None);
    assert_eq!(format_nusd(1_500_000_001), "1.500000001");
    assert_eq!(day_of(0), "1970-01-01");
    assert_eq!(parse_day("2026-11-29").map(day_of).as_deref(), Some("2026-11-29"));
    assert_eq!(parse_day("2024-02-29").map(month_of).as_deref(), Some("2024-02"));
    assert_eq!(parse_day("2026-02-30"), None);
    assert_eq!(parse_day("nope"), None);
    // Rounding: half up, once per class.
    assert_eq!(class_cost(1, 500), 1);
    assert_eq!(class_cost(1, 499), 0);
    assert_eq!(class_cost(3, 150_000), 450);
}

fn outbox_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("usage-outbox-")
        })
        .count()
}

/// A request admitted (marked) by a process that died before its final record is recorded
/// as `interrupted` with its prompt by the next process; a request whose final record is
/// there (even in a later segment) is recorded once, as finished; a live process never
/// replays its own marks.
#[test]
fn admitted_requests_of_a_dead_process_are_recorded_as_interrupted() {
    let dir = std::env::temp_dir().join(format!("hearth-outbox-marks-{}-{}", std::process::id(), now_ms()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("ledger.db").display());
    {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let db = hearth_tenants::db::open(&url, None).await.unwrap();
            tenant(&db, "tn_m").await;
            let l = UsageLedger::with_outbox(&db, &dir).await.unwrap();
            let mut streaming = rec("streaming", "tn_m", "m", 7, 0, 0, now_ms());
            streaming.status = UsageStatus::Failed.as_str().into();
            let finished = rec("finished", "tn_m", "m", 9, 0, 4, now_ms());
            // Both admitted; one finishes; the database is gone for its commit.
            let mark_streaming = l.admit(&streaming).expect("mark");
            let mark_finished = l.admit(&finished).expect("mark");
            db.pool.close().await;
            l.record_durable(&finished).await.unwrap();
            drop(mark_finished);
            mark_streaming.abandon(); // the process dies with it
        });
        rt.shutdown_timeout(std::time::Duration::from_millis(100));
    }
    assert!(outbox_files(&dir) >= 1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let db = hearth_tenants::db::open(&url, None).await.unwrap();
        let l = UsageLedger::with_outbox(&db, &dir).await.unwrap();
        let mut rows = l.recent(Some("tn_m"), 10).await.unwrap();
        rows.sort_by(|a, b| a.rec.request_id.cmp(&b.rec.request_id));
        let got: Vec<(&str, &str, u32, u32, Option<&str>)> = rows
            .iter()
            .map(|r| {
                (
                    r.rec.request_id.as_str(),
                    r.rec.status.as_str(),
                    r.rec.prompt_tokens,
                    r.rec.completion_tokens,
                    r.rec.error_code.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("finished", "completed", 9, 4, None),
                ("streaming", "interrupted", 7, 0, Some("gateway_interrupted")),
            ]
        );
        // The prompt of the interrupted request is billed (at the default price: none here).
        assert_eq!(l.recover_dir(&dir).await.unwrap(), 0);
        assert_eq!(outbox_files(&dir), 1, "only this process's current segment remains");
    });
    std::fs::remove_dir_all(&dir).ok();
}

/// A mark holds its segment until the final record is appended: a finished request leaves
/// nothing behind, and `fsync` durability commits like `write`.
#[tokio::test]
async fn marks_are_resolved_and_fsync_durability_records() {
    let dir = std::env::temp_dir().join(format!("hearth-outbox-fsync-{}-{}", std::process::id(), now_ms()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = testing::sqlite().await;
    tenant(&db, "tn_f").await;
    let l = UsageLedger::with_outbox_durability(&db, &dir, outbox::Durability::Fsync)
        .await
        .unwrap();
    assert_eq!(l.durability(), outbox::Durability::Fsync);
    let mut tasks = Vec::new();
    for i in 0..32 {
        let l = l.clone();
        tasks.push(tokio::spawn(async move {
            let r = rec(&format!("f{i}"), "tn_f", "m", 5, 0, 5, now_ms());
            let mark = l.admit(&r);
            let done = l.record(&r).await.unwrap();
            drop(mark);
            done
        }));
    }
    for t in tasks {
        assert!(t.await.unwrap().inserted);
    }
    assert_eq!(l.recent(Some("tn_f"), 100).await.unwrap().len(), 32);
    assert_eq!(outbox_files(&dir), 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// Group commit: every ticket up to the last append is flushed by one caller's fsync.
#[test]
fn outbox_sync_covers_every_earlier_append() {
    let dir = std::env::temp_dir().join(format!("hearth-outbox-sync-{}-{}", std::process::id(), now_ms()));
    let ob = std::sync::Arc::new(outbox::Outbox::open(&dir).unwrap());
    let tickets: Vec<u64> = (0..10)
        .map(|i| ob.append(&rec(&format!("s{i}"), "t", "m", 1, 0, 1, 0)).unwrap().1)
        .collect();
    assert_eq!(tickets, (1..=10).collect::<Vec<_>>());
    let threads: Vec<_> = tickets
        .iter()
        .map(|&t| {
            let ob = ob.clone();
            std::thread::spawn(move || ob.sync_to(t))
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// With the outbox unwritable (its directory gone: the disk failed), a record goes to the
/// database directly and the ledger says so; with the database failing too it refuses.
#[tokio::test]
async fn an_unwritable_outbox_falls_back_to_the_database() {
    let dir = std::env::temp_dir().join(format!("hearth-outbox-full-{}-{}", std::process::id(), now_ms()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = testing::sqlite().await;
    tenant(&db, "tn_d").await;
    let l = UsageLedger::with_outbox(&db, &dir).await.unwrap();
    // A full disk, simulated at the file: the current segment's descriptor is replaced by
    // one that cannot be written (a read-only handle on the same file).
    l.outbox.as_ref().unwrap().break_for_tests();
    let r = l.record(&rec("direct", "tn_d", "m", 5, 0, 5, now_ms())).await.unwrap();
    assert!(r.inserted, "the record reached the database directly");
    assert!(l.health().outbox_failing.load(std::sync::atomic::Ordering::Relaxed));
    assert!(l.health().outbox_errors.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    assert!(l.admit(&rec("m", "tn_d", "m", 5, 0, 5, now_ms())).is_none());
    assert!(l.accepting(), "the database still takes records");
    db.pool.close().await;
    assert!(l
        .record_durable(&rec("lost?", "tn_d", "m", 5, 0, 5, now_ms()))
        .await
        .is_err());
    l.flush().await;
    // Neither takes records: requests are refused, but one a second goes through as a
    // probe (so the state clears once either recovers).
    let admitted = (0..5).filter(|_| l.accepting()).count();
    assert_eq!(admitted, 1, "one probe, the rest refused");
    assert!(!l.accepting());
    std::fs::remove_dir_all(&dir).ok();
}
