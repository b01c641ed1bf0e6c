//! `hearth bench agent`: agent-shaped work on the real engine (in process), with and
//! without speculative decoding, in one run.
//!
//! Workloads (each prompt rendered with the model's chat template, as the gateway does):
//! - `extraction`: a generated support ticket and a JSON Schema for its fields
//!   (`response_format` json_schema: constrained decoding); the answer copies from the ticket;
//! - `tool_call`: an agent turn whose history holds earlier calls and results, with
//!   `tool_choice: "required"` (the gateway's own tool prompt and call grammar);
//! - `edit`: "return this document with one change", unconstrained; the answer is mostly the
//!   document again;
//! - `chat`: open-ended questions (little to look up: the no-regression check).
//!
//! Each request runs twice (greedily, but for the sampled chat), speculation on and off (alternating, same engine, so
//! the prefix cache serves both alike); decode tokens/s is output tokens after the first ÷
//! the time from the first token to the last. Answers must be identical both ways (the
//! sampled workload uses one seed for both).
//! Then `seeds` extraction and tool-call requests at temperature 1.0 run eight at a time
//! (speculation off) for the grammar mask's cost at batch 8: eight masks per step against
//! the step time while all eight decode (from the last first token to the first last
//! token: prefill left out) — the mask's share of the per-token time. Every constrained
//! answer of the whole run is checked against its schema with a JSON Schema validator.

use std::path::PathBuf;
use std::time::Instant;

use hearth_engine::{EngineConfig, EngineHandle};
use hearth_gateway::api::tools::{in_hearth_format, parse_tools, Tools};
use hearth_protocol::output::{ToolFormat, ToolStream};
use hearth_protocol::{
    ChatMessage, ChatTemplate, Constraint, FinishReason, GenerateEvent, GenerateRequest, Priority, Qos, SamplingParams,
    Tokenizer,
};
use serde::Serialize;
use serde_json::{json, Value};

use crate::Rng;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub model: PathBuf,
    pub model_id: String,
    /// Engine settings (threads, `speculative_tokens`…).
    pub engine: EngineConfig,
    /// Requests per workload, each run with and without speculation.
    pub requests: usize,
    /// Temperature-1.0 constrained requests (in batches of eight) for the mask and validity.
    pub seeds: usize,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    pub workload: String,
    pub constrained: bool,
    pub requests: usize,
    pub output_tokens: u64,
    /// Decode tokens/s without and with speculation (greedy, batch 1).
    pub decode_tok_s_off: f64,
    pub decode_tok_s_on: f64,
    pub speedup: f64,
    pub drafted: u64,
    pub accepted: u64,
    /// Accepted ÷ drafted draft tokens.
    pub acceptance: f64,
    /// Output tokens per verification step with speculation (1.0 = no gain).
    pub tokens_per_step: f64,
    /// Answers identical with and without speculation (greedy, or sampled with the same
    /// seed: one random draw per token either way).
    pub identical: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct MaskResult {
    pub batch: usize,
    pub requests: usize,
    pub output_tokens: u64,
    pub masks: u64,
    pub mask_us_per_token: f64,
    /// Time per generated token of one sequence while all eight decode (the step time).
    pub step_ms: f64,
    /// Eight masks ÷ the step time: the mask's share of per-token time (target ≤ 0.10).
    pub mask_share: f64,
}

/// Constrained answers under a tight budget.
#[derive(Debug, Clone, Serialize)]
pub struct TightBudget {
    pub max_tokens: u32,
    pub mask: MaskResult,
    pub valid: usize,
    pub checked: usize,
    /// Ended by the budget (closed early: `length`, still valid).
    pub cut: usize,
}

/// The tight budget: below what an extraction answer usually takes (about 185 tokens), above
/// its shortest valid one (about 55: seven required fields and an item).
const TIGHT_BUDGET: u32 = 80;

#[derive(Debug, Clone, Serialize)]
pub struct AgentReport {
    pub isa: String,
    pub cpu: String,
    pub model: String,
    pub speculative_tokens: usize,
    pub workloads: Vec<WorkloadResult>,
    pub mask: MaskResult,
    /// The same constrained requests with a tight `max_tokens`: the grammar plans and follows
    /// the shortest valid end, so every answer still parses.
    pub tight: TightBudget,
    /// Constrained answers that parse and validate against their schema, of all checked
    /// (greedy and temperature 1.0; target 1.0).
    pub valid: usize,
    pub checked: usize,
    /// Of those checked, cut off by `max_tokens` (cannot be complete JSON; the schemas
    /// bound their strings so that this stays 0).
    pub truncated: usize,
    pub validity_rate: f64,
}

impl AgentReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "Agent workloads on the engine (ISA {}; {}), model {}, up to {} draft tokens (prompt lookup)\n\n",
            self.isa, self.cpu, self.model, self.speculative_tokens
        );
        out += "| workload | constrained | requests | output tokens | decode tok/s off | decode tok/s on | speedup | drafted | accepted | acceptance | tokens/step | identical |\n";
        out += "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
        for w in &self.workloads {
            out += &format!(
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.2}× | {} | {} | {:.1}% | {:.2} | {}/{} |\n",
                w.workload,
                if w.constrained { "yes" } else { "no" },
                w.requests,
                w.output_tokens,
                w.decode_tok_s_off,
                w.decode_tok_s_on,
                w.speedup,
                w.drafted,
                w.accepted,
                100.0 * w.acceptance,
                w.tokens_per_step,
                w.identical,
                w.requests,
            );
        }
        let m = &self.mask;
        out += &format!(
            "\nGrammar mask at batch {} (temperature 1.0, {} constrained requests, {} tokens): {:.0} µs per token, \
             step {:.1} ms per token, mask share of per-token time {:.1}% (target ≤ 10%)\n\
             Schema validity: {}/{} constrained answers parse and validate ({:.1}%; target 100%); {} cut off by max_tokens\n\
             Targets: speculation ≥ 1.5× on edit/extraction, ≥ 0.95× on chat\n",
            m.batch,
            m.requests,
            m.output_tokens,
            m.mask_us_per_token,
            m.step_ms,
            100.0 * m.mask_share,
            self.valid,
            self.checked,
            100.0 * self.validity_rate,
            self.truncated
        );
        let t = &self.tight;
        out += &format!(
            "\n| max_tokens | requests | output tokens | mask µs/token (incl. closing plans) | mask share | valid | cut by the budget |\n\
             |---|---|---|---|---|---|---|\n\
             | own (≤ 400) | {} | {} | {:.0} | {:.1}% | {}/{} | {} |\n\
             | {} | {} | {} | {:.0} | {:.1}% | {}/{} | {} |\n",
            self.mask.requests,
            self.mask.output_tokens,
            self.mask.mask_us_per_token,
            100.0 * self.mask.mask_share,
            self.valid,
            self.checked,
            self.truncated,
            t.max_tokens,
            t.mask.requests,
            t.mask.output_tokens,
            t.mask.mask_us_per_token,
            100.0 * t.mask.mask_share,
            t.valid,
            t.checked,
            t.cut,
        );
        out
    }
}

/// How an answer is checked.
#[derive(Clone)]
enum Check {
    None,
    Schema(Value),
    Tools(Box<Tools>),
}

#[derive(Clone)]
struct Task {
    workload: &'static str,
    messages: Vec<ChatMessage>,
    constraint: Option<Constraint>,
    check: Check,
    max_tokens: u32,
    temperature: f32,
}

const NAMES: &[&str] = &[
    "Maria Gonzalez",
    "James Okafor",
    "Chen Wei",
    "Priya Raman",
    "Lukas Brandt",
    "Aiko Tanaka",
    "Sofia Rossi",
    "Daniel Evans",
];
const CITIES: &[&str] = &[
    "Lisbon", "Toronto", "Osaka", "Nairobi", "Denver", "Lyon", "Pune", "Hamburg",
];
const STREETS: &[&str] = &[
    "Harbor Lane",
    "Maple Avenue",
    "Rua das Flores",
    "King Street",
    "Elm Road",
];
const PRODUCTS: &[&str] = &[
    "wireless keyboard",
    "USB-C docking station",
    "27-inch monitor",
    "noise-cancelling headphones",
    "ergonomic office chair",
    "mechanical pencil set",
    "standing desk frame",
    "webcam with privacy shutter",
];
const PROBLEMS: &[&str] = &[
    "arrived with a cracked casing",
    "stopped working after two days",
    "was missing its power adapter",
    "was the wrong colour",
    "makes a loud buzzing noise",
];

/// The extraction schema: the ticket's fields.
fn ticket_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "customer": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "maxLength": 60},
            "order_id": {"type": "string", "maxLength": 20},
            "city": {"type": "string", "maxLength": 30},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string", "maxLength": 40},
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number"}
                    },
                    "required": ["product", "quantity", "unit_price"],
                    "additionalProperties": false
                },
                "minItems": 1,
                "maxItems": 3
            },
            "problem": {"type": "string", "maxLength": 80},
            "wants_refund": {"type": "boolean"}
        },
        "required": ["customer", "email", "order_id", "city", "items", "problem", "wants_refund"],
        "additionalProperties": false
    })
}

fn ticket(rng: &mut Rng) -> (String, String, String) {
    let name = rng.pick(NAMES);
    let city = rng.pick(CITIES);
    let order = format!("ORD-{}-{}", rng.range(2024, 2026), rng.range(10_000, 99_999));
    let email = format!("{}@example.com", name.to_lowercase().replace(' ', "."));
    let mut items = String::new();
    for k in 0..rng.range(1, 3) {
        let product = rng.pick(PRODUCTS);
        let qty = rng.range(1, 4);
        let price = rng.range(15, 400);
        if k > 0 {
            items += ", and ";
        }
        items += &format!("{qty} × {product} at ${price}.99 each");
    }
    let problem = rng.pick(PROBLEMS);
    let text = format!(
        "Support ticket #{}\nFrom: {name} <{email}>\nShipping address: {} {}, {city}\n\n\
         Hello, my name is {name} and I placed order {order} last week. The order contained {items}. \
         Unfortunately the {} {problem}. I have been a customer for years and this is the first time \
         something like this has happened. I would like a full refund for order {order}, or a replacement \
         shipped to my address in {city} if a refund is not possible. Please reply to {email}.\n\nThanks,\n{name}",
        rng.range(1000, 9999),
        rng.range(1, 300),
        rng.pick(STREETS),
        rng.pick(PRODUCTS),
    );
    (text, order, city.to_string())
}

fn system(content: &str) -> ChatMessage {
    ChatMessage::new("system", content)
}

fn user(content: String) -> ChatMessage {
    ChatMessage::new("user", &content)
}

fn extraction(rng: &mut Rng) -> Task {
    let (text, _, _) = ticket(rng);
    let schema = ticket_schema();
    Task {
        workload: "extraction",
        messages: vec![
            system("You extract structured data from support tickets. Answer with JSON only."),
            user(format!(
                "Extract the customer, email, order id, city, items (product, quantity, unit price), \
                 the problem and whether they want a refund from this ticket:\n\n{text}"
            )),
        ],
        constraint: Some(Constraint::JsonSchema { schema: schema.clone() }),
        check: Check::Schema(schema),
        max_tokens: 512,
        temperature: 0.0,
    }
}

fn agent_tools() -> anyhow::Result<Tools> {
    let body = json!({
        "tools": [
            {"type": "function", "function": {
                "name": "lookup_order",
                "description": "Look up an order by its id.",
                "parameters": {"type": "object", "properties": {"order_id": {"type": "string", "maxLength": 20}},
                               "required": ["order_id"], "additionalProperties": false}}},
            {"type": "function", "function": {
                "name": "issue_refund",
                "description": "Refund an order, fully or in part.",
                "parameters": {"type": "object", "properties": {
                    "order_id": {"type": "string", "maxLength": 20},
                    "amount": {"type": "number", "minimum": 0},
                    "reason": {"type": "string", "maxLength": 80}},
                    "required": ["order_id", "amount", "reason"], "additionalProperties": false}}},
            {"type": "function", "function": {
                "name": "send_email",
                "description": "Send an email to a customer.",
                "parameters": {"type": "object", "properties": {
                    "to": {"type": "string", "maxLength": 60},
                    "subject": {"type": "string", "maxLength": 60},
                    "body": {"type": "string", "maxLength": 200}},
                    "required": ["to", "subject", "body"], "additionalProperties": false}}}
        ],
        "tool_choice": "required",
        "parallel_tool_calls": false
    });
    let obj = body.as_object().cloned().unwrap_or_default();
    // The gateway's own parser: a mistake here fails the run instead of measuring no tools.
    parse_tools(&obj)
        .map_err(|e| anyhow::anyhow!("the workload's tools: {}", e.message))?
        .ok_or_else(|| anyhow::anyhow!("the workload has no tools"))
}

/// An agent turn: the ticket, an earlier lookup and its result, and the next step to take.
fn tool_call(rng: &mut Rng) -> anyhow::Result<Task> {
    let (text, order, city) = ticket(rng);
    let tools = agent_tools()?;
    // The history as the gateway writes it (Hearth's format, the default model's template
    // taking no tools): the earlier call, then its result.
    let mut lookup = ChatMessage::new("assistant", "");
    lookup.tool_calls = vec![hearth_protocol::ToolCall {
        id: "call_1".into(),
        kind: "function".into(),
        function: hearth_protocol::FunctionCall {
            name: "lookup_order".into(),
            arguments: json!({"order_id": order}),
        },
    }];
    let mut result = ChatMessage::new(
        "tool",
        &json!({"order_id": order, "status": "delivered", "city": city, "total": rng.range(40, 900) as f64 + 0.99,
                "refundable": true})
        .to_string(),
    );
    result.tool_call_id = Some("call_1".into());
    let next = if rng.next().is_multiple_of(2) {
        "The order is refundable. Issue the full refund for it now."
    } else {
        "Email the customer that their refund for this order is being processed."
    };
    let messages = in_hearth_format(
        &[
            system("You are a customer-support agent for an electronics shop."),
            user(format!("Handle this ticket:\n\n{text}")),
            lookup,
            result,
            user(next.to_string()),
        ],
        Some(&tools),
    );
    Ok(Task {
        workload: "tool_call",
        messages,
        constraint: tools.constraint(ToolFormat::Hearth, &|_| None),
        check: Check::Tools(Box::new(tools)),
        max_tokens: 512,
        temperature: 0.0,
    })
}

const PARAGRAPHS: &[&str] = &[
    "The quarterly review meeting will take place on Thursday in the main conference room. All team leads are expected to present a short summary of their progress, including any risks to the delivery schedule.",
    "Our new onboarding process gives every engineer a mentor for the first month. The mentor helps with setting up the development environment, reviewing the first pull requests and explaining how the release train works.",
    "The office kitchen will be closed for renovation from Monday until the end of the month. During this time, coffee and snacks will be available on the second floor next to the reception desk.",
    "Customer feedback from the last survey shows that most users value fast support responses over new features. The support team will therefore add two more people to the evening shift starting next week.",
    "Please remember that all expense reports must be submitted before the fifth day of the following month. Reports submitted after that date will be processed in the next payment cycle.",
    "The data center migration is planned for the first weekend of next month. Services may be unavailable for up to four hours on Saturday night while the databases are copied to the new hardware.",
];

const EDITS: &[(&str, &str)] = &[
    ("Thursday", "Friday"),
    ("month", "quarter"),
    ("team", "group"),
    ("next week", "next month"),
    ("the", "our"),
];

fn edit(rng: &mut Rng) -> Task {
    let start = (rng.next() % PARAGRAPHS.len() as u64) as usize;
    let doc: Vec<&str> = (0..3).map(|k| PARAGRAPHS[(start + k) % PARAGRAPHS.len()]).collect();
    let doc = doc.join("\n\n");
    let (from, to) = EDITS[(rng.next() % EDITS.len() as u64) as usize];
    Task {
        workload: "edit",
        messages: vec![
            system("You are a careful copy editor. Return the full revised document and nothing else."),
            user(format!(
                "Here is a document:\n\n{doc}\n\nRewrite the document above, replacing the word \"{from}\" with \"{to}\". \
                 Keep everything else exactly the same and output the whole document."
            )),
        ],
        constraint: None,
        check: Check::None,
        max_tokens: 200,
        temperature: 0.0,
    }
}

const QUESTIONS: &[&str] = &[
    "Write a short poem about the sea at night.",
    "What are three good habits for staying healthy?",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue? Explain it simply.",
    "Give me some ideas for a weekend trip in the mountains.",
    "What should I know before adopting a cat?",
];

fn chat(rng: &mut Rng) -> Task {
    Task {
        workload: "chat",
        messages: vec![user(rng.pick(QUESTIONS).to_string())],
        constraint: None,
        check: Check::None,
        max_tokens: 160,
        temperature: 0.0,
    }
}

/// Chat sampled at temperature 1.0: text a small model does not repeat.
fn chat_sampled(rng: &mut Rng) -> Task {
    Task {
        workload: "chat (temperature 1)",
        temperature: 1.0,
        ..chat(rng)
    }
}

struct Outcome {
    text: String,
    finish: FinishReason,
    tokens: u64,
    /// First token to last, seconds.
    decode_seconds: f64,
    /// When each token arrived.
    times: Vec<Instant>,
}

struct Bench {
    model_id: String,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    next_id: u64,
}

impl Bench {
    fn request(
        &mut self,
        task: &Task,
        speculative: bool,
        temperature: f32,
        seed: u64,
    ) -> anyhow::Result<GenerateRequest> {
        let temperature = task.temperature.max(temperature);
        let text = self.template.render(&task.messages, true)?;
        self.next_id += 1;
        Ok(GenerateRequest {
            request_id: format!("agent-{}", self.next_id),
            model: self.model_id.clone(),
            prompt: self.tokenizer.encode(&text),
            sampling: SamplingParams {
                max_tokens: task.max_tokens,
                temperature,
                seed: Some(seed),
                speculative,
                ..Default::default()
            },
            cache_namespace: "bench".into(),
            n: 1,
            prefill_only: false,
            resume: Vec::new(),
            kv_source: None,
            qos: Qos {
                tenant: "bench".into(),
                priority: Priority::Interactive,
                share: 1,
            },
            constraint: task.constraint.clone(),
            adapter: None,
        })
    }
}

async fn run_one(engine: EngineHandle, req: GenerateRequest) -> anyhow::Result<Outcome> {
    let mut rx = engine.generate(req);
    let (mut first, mut last) = (None, None);
    let mut times = Vec::new();
    let mut text = String::new();
    let mut tokens = 0u64;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { text: t, .. } => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
                times.push(now);
                tokens += 1;
                text.push_str(&t);
            }
            GenerateEvent::Finish { .. } => {}
            GenerateEvent::Done { finish_reason, .. } => {
                let decode_seconds = match (first, last) {
                    (Some(f), Some(l)) => (l - f).as_secs_f64(),
                    _ => 0.0,
                };
                return Ok(Outcome {
                    text,
                    finish: finish_reason,
                    tokens,
                    decode_seconds,
                    times,
                });
            }
            GenerateEvent::Error { message, code, .. } => anyhow::bail!("engine error {code}: {message}"),
        }
    }
    anyhow::bail!("the engine closed the stream without Done")
}

/// Whether `text` satisfies the task's check (true when there is nothing to check).
fn valid(check: &Check, text: &str) -> bool {
    match check {
        Check::None => true,
        Check::Schema(schema) => serde_json::from_str::<Value>(text)
            .ok()
            .is_some_and(|v| jsonschema::is_valid(schema, &v)),
        Check::Tools(tools) => {
            let (_, calls) = ToolStream::parse(ToolFormat::Hearth, &tools.tools, text);
            !calls.is_empty()
                && calls.iter().all(|c| {
                    let Some(tool) = tools.tools.iter().find(|t| t.name == c.name) else {
                        return false;
                    };
                    serde_json::from_str::<Value>(&c.arguments)
                        .ok()
                        .is_some_and(|a| jsonschema::is_valid(&tool.parameters, &a))
                })
        }
    }
}

pub async fn run(cfg: AgentConfig) -> anyhow::Result<AgentReport> {
    let engine = EngineHandle::load(&cfg.model, &cfg.model_id, &cfg.engine)?;
    let spec = &engine.info().tokenizer;
    let tokenizer = Tokenizer::from_spec(spec)?;
    let source = spec
        .chat_template
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the model has no chat template"))?;
    let template = ChatTemplate::for_tokenizer(&source, &tokenizer)?;
    let mut bench = Bench {
        model_id: cfg.model_id.clone(),
        tokenizer,
        template,
        next_id: 0,
    };
    let metrics = engine.metrics();
    let mut rng = Rng(cfg.seed.max(1));
    let (mut valid_count, mut checked, mut truncated) = (0usize, 0usize, 0usize);
    let makers: [fn(&mut Rng) -> anyhow::Result<Task>; 5] = [
        |r| Ok(extraction(r)),
        tool_call,
        |r| Ok(edit(r)),
        |r| Ok(chat(r)),
        |r| Ok(chat_sampled(r)),
    ];
    let mut workloads = Vec::new();
    // Warm-up: the first constrained request builds the token trie; not measured.
    let warm = extraction(&mut rng);
    run_one(engine.clone(), bench.request(&warm, false, 0.0, 0)?).await?;
    for make in makers {
        let tasks = (0..cfg.requests)
            .map(|_| make(&mut rng))
            .collect::<anyhow::Result<Vec<Task>>>()?;
        let (mut t_off, mut t_on, mut n_off, mut n_on) = (0.0, 0.0, 0u64, 0u64);
        let (mut tokens, mut identical) = (0u64, 0usize);
        let (mut drafted, mut accepted) = (0u64, 0u64);
        for (k, task) in tasks.iter().enumerate() {
            let mut texts = [String::new(), String::new()];
            // Alternate which runs first, so neither always finds the other's cache.
            let order = if k % 2 == 0 { [false, true] } else { [true, false] };
            for on in order {
                let (d0, a0) = (metrics.spec_drafted.get(), metrics.spec_accepted.get());
                let out = run_one(engine.clone(), bench.request(task, on, 0.0, 0)?).await?;
                let decode_tokens = out.tokens.saturating_sub(1);
                if on {
                    t_on += out.decode_seconds;
                    n_on += decode_tokens;
                    drafted += metrics.spec_drafted.get() - d0;
                    accepted += metrics.spec_accepted.get() - a0;
                } else {
                    t_off += out.decode_seconds;
                    n_off += decode_tokens;
                    tokens += out.tokens;
                }
                if !matches!(task.check, Check::None) {
                    checked += 1;
                    truncated += usize::from(out.finish == FinishReason::Length);
                    valid_count += usize::from(valid(&task.check, &out.text));
                }
                texts[usize::from(on)] = out.text;
            }
            identical += usize::from(texts[0] == texts[1]);
        }
        let off = n_off as f64 / t_off.max(1e-9);
        let on = n_on as f64 / t_on.max(1e-9);
        // Steps with speculation: each accepted draft token saved one.
        let steps = n_on.saturating_sub(accepted).max(1);
        workloads.push(WorkloadResult {
            workload: tasks.first().map_or("", |t| t.workload).into(),
            constrained: tasks.first().is_some_and(|t| t.constraint.is_some()),
            requests: tasks.len(),
            output_tokens: tokens,
            decode_tok_s_off: off,
            decode_tok_s_on: on,
            speedup: on / off.max(1e-9),
            drafted,
            accepted,
            acceptance: accepted as f64 / drafted.max(1) as f64,
            tokens_per_step: n_on as f64 / steps as f64,
            identical,
        });
    }

    // The mask at batch 8: constrained requests at temperature 1.0, eight at a time — with
    // their own budgets, then with a tight one (the grammar plans its closing).
    let loose = mask_run(&engine, &mut bench, &mut rng, cfg.seeds, cfg.seed, None).await?;
    valid_count += loose.valid;
    checked += loose.checked;
    truncated += loose.truncated;
    let tight = mask_run(&engine, &mut bench, &mut rng, cfg.seeds, cfg.seed, Some(TIGHT_BUDGET)).await?;
    Ok(AgentReport {
        isa: hearth_engine::kernels::isa().name().to_string(),
        cpu: hearth_engine::kernels::cpu_features(),
        model: cfg.model_id,
        speculative_tokens: cfg.engine.speculative_tokens,
        workloads,
        mask: loose.result,
        tight: TightBudget {
            max_tokens: TIGHT_BUDGET,
            mask: tight.result,
            valid: tight.valid,
            checked: tight.checked,
            cut: tight.truncated,
        },
        valid: valid_count,
        checked,
        truncated,
        validity_rate: valid_count as f64 / checked.max(1) as f64,
    })
}

/// One pass of the mask measurement: the answers' validity and the mask's cost.
struct MaskRun {
    result: MaskResult,
    valid: usize,
    checked: usize,
    truncated: usize,
}

async fn mask_run(
    engine: &EngineHandle,
    bench: &mut Bench,
    rng: &mut Rng,
    seeds: usize,
    seed: u64,
    budget: Option<u32>,
) -> anyhow::Result<MaskRun> {
    const BATCH: usize = 8;
    let metrics = engine.metrics();
    let (m0, s0) = (metrics.grammar_masks.get(), metrics.grammar_mask_seconds.get());
    // Seconds and tokens while all of a batch decode.
    let (mut window, mut window_tokens) = (0.0, 0usize);
    let (mut mask_tokens, mut mask_requests) = (0u64, 0usize);
    let (mut valid_count, mut checked, mut truncated) = (0usize, 0usize, 0usize);
    let mut k = 0u64;
    while mask_requests < seeds {
        let n = BATCH.min(seeds - mask_requests);
        let mut batch = Vec::new();
        for _ in 0..n {
            k += 1;
            let task = if k.is_multiple_of(2) {
                extraction(rng)
            } else {
                tool_call(rng)?
            };
            let mut req = bench.request(&task, false, 1.0, seed.wrapping_add(k))?;
            if let Some(b) = budget {
                req.sampling.max_tokens = req.sampling.max_tokens.min(b);
            }
            batch.push((task.check, tokio::spawn(run_one(engine.clone(), req))));
        }
        let mut outs = Vec::new();
        for (check, h) in batch {
            outs.push((check, h.await??));
        }
        if n == BATCH {
            let start = outs.iter().filter_map(|(_, o)| o.times.first()).max().copied();
            let end = outs.iter().filter_map(|(_, o)| o.times.last()).min().copied();
            if let (Some(start), Some(end)) = (start, end) {
                if end > start {
                    window += (end - start).as_secs_f64();
                    window_tokens += outs
                        .iter()
                        .map(|(_, o)| o.times.iter().filter(|t| **t > start && **t <= end).count())
                        .sum::<usize>();
                }
            }
        }
        for (check, out) in outs {
            mask_tokens += out.tokens;
            checked += 1;
            truncated += usize::from(out.finish == FinishReason::Length);
            valid_count += usize::from(valid(&check, &out.text));
        }
        mask_requests += n;
    }
    let masks = metrics.grammar_masks.get() - m0;
    let mask_seconds = metrics.grammar_mask_seconds.get() - s0;
    let mask_us_per_token = mask_seconds * 1e6 / masks.max(1) as f64;
    let step_ms = window * 1000.0 * BATCH as f64 / window_tokens.max(1) as f64;
    Ok(MaskRun {
        result: MaskResult {
            batch: BATCH,
            requests: mask_requests,
            output_tokens: mask_tokens,
            masks,
            mask_us_per_token,
            step_ms,
            mask_share: BATCH as f64 * mask_us_per_token / 1000.0 / step_ms.max(1e-9),
        },
        valid: valid_count,
        checked,
        truncated,
    })
}
