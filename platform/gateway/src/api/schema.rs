//! The wire shapes the OpenAPI documents name ([`crate::routes::openapi`]): the model APIs
//! parse their bodies by hand (for OpenAI's precise `param`/`code` errors), so their
//! request and response shapes are written out here, for the documents only, and
//! `scripts/api-check` holds the server to them.

use serde_json::Value;
use utoipa::ToSchema;

// ---- shared shapes -------------------------------------------------------------------

/// A list: `{"object": "list", "data": [...]}`.
#[derive(ToSchema)]
#[schema(bound = "T: ToSchema")]
pub struct List<T> {
    /// Always `list`.
    #[schema(inline, value_type = String, example = "list")]
    pub object: String,
    pub data: Vec<T>,
}

/// Any JSON object (the handler documents its fields in its description).
#[derive(ToSchema)]
#[schema(value_type = Object)]
pub struct AnyObject(#[allow(dead_code)] Value);

/// One server-sent event of a streamed answer: chat and completions send `data` only (a
/// JSON chunk, then `[DONE]`); Responses and Messages name each event (`event`) and send
/// its JSON as `data`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct SseEvent {
    event: Option<String>,
    data: String,
    id: Option<String>,
}

/// A WebAssembly component (or core module), the raw bytes.
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
pub struct Wasm(#[allow(dead_code)] Vec<u8>);

/// Anthropic's error shape (`/v1/messages`): `{"type": "error", "error": {"type", "message"}}`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct AnthropicError {
    /// Always `error`.
    r#type: String,
    error: AnthropicErrorInner,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct AnthropicErrorInner {
    /// `invalid_request_error`, `authentication_error`, `permission_error`, `not_found_error`,
    /// `rate_limit_error`, `api_error`, `overloaded_error`.
    r#type: String,
    message: String,
}

/// `{"id", "object", "deleted": true}`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct Deleted {
    id: String,
    object: Option<String>,
    deleted: bool,
}

// ---- the model APIs ------------------------------------------------------------------

/// A message's author. `developer` is `system`.
#[derive(ToSchema, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

/// A text part of a message's content.
#[derive(ToSchema, serde::Serialize)]
#[allow(dead_code)]
pub struct TextPart {
    /// `text`.
    #[schema(pattern = "^text$")]
    r#type: String,
    text: String,
}

/// A string, or an array of text parts.
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum Content {
    Text(String),
    Parts(Vec<TextPart>),
}

/// A stop sequence, or up to 4 (none empty).
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A prompt: a string, or token ids.
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `none`, `auto`, `required`, or a function the answer must call (named in `tools`):
/// `{"type": "function", "function": {"name"}}` (Responses: `{"type": "function", "name"}`).
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum ToolChoice {
    Mode(ToolChoiceMode),
    #[schema(value_type = Object)]
    Function(Value),
}

#[derive(ToSchema, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum ToolChoiceMode {
    None,
    Auto,
    Required,
}

/// A USD amount: a decimal string (`"12.50"`, exact) or a number.
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum Usd {
    Text(String),
    Number(f64),
}

/// A function the model may call.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct FunctionTool {
    /// `function`.
    #[schema(pattern = "^function$")]
    r#type: String,
    function: Function,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct Function {
    name: String,
    description: Option<String>,
    /// A JSON Schema for the arguments (constrained calls: the grammar engine's subset).
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
    strict: Option<bool>,
}

/// A chat message: assistant messages may carry `tool_calls` (and `reasoning_content`),
/// tool results come as `role: "tool"` with `tool_call_id`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ChatMessage {
    role: Role,
    #[schema(nullable)]
    content: Option<Content>,
    name: Option<String>,
    #[schema(value_type = Option<Vec<Object>>)]
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
    reasoning_content: Option<String>,
}

/// `POST /v1/chat/completions`. Hearth-specific extensions: `top_k`, `ignore_eos`,
/// `min_tokens` (vLLM's), `speculative: false`, `chat_template_kwargs`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ChatCompletionRequest {
    /// A model id from `GET /v1/models`.
    #[schema(min_length = 1)]
    model: String,
    #[schema(min_items = 1)]
    messages: Vec<ChatMessage>,
    /// The completion budget (default: the room the prompt leaves, or the gateway's
    /// `--default-max-tokens`); prompt + budget must fit the context.
    #[schema(minimum = 1)]
    max_tokens: Option<u32>,
    #[schema(minimum = 1)]
    max_completion_tokens: Option<u32>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    temperature: Option<f64>,
    #[schema(minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    /// -1 or 0: off.
    #[schema(minimum = -1)]
    top_k: Option<i64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    /// Completions to generate, sharing the prompt's KV blocks.
    #[schema(minimum = 1, maximum = 16)]
    n: Option<u32>,
    logprobs: Option<bool>,
    #[schema(minimum = 0, maximum = 20)]
    top_logprobs: Option<u32>,
    /// Only 0 is supported.
    #[schema(minimum = -2.0, maximum = 2.0)]
    presence_penalty: Option<f64>,
    /// Only 0 is supported.
    #[schema(minimum = -2.0, maximum = 2.0)]
    frequency_penalty: Option<f64>,
    stream: Option<bool>,
    /// `{"include_usage": true}`: a last chunk carries `usage`.
    #[schema(value_type = Option<Object>)]
    stream_options: Option<Value>,
    tools: Option<Vec<FunctionTool>>,
    tool_choice: Option<ToolChoice>,
    parallel_tool_calls: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`; always
    /// grammar-constrained.
    #[schema(value_type = Option<Object>)]
    response_format: Option<Value>,
    /// Separates this client's prefix cache from the tenant's other traffic.
    #[schema(max_length = 256)]
    prompt_cache_key: Option<String>,
    /// `interactive` (also `auto`, `default`, `priority`) or `batch` (`flex`, `scale`); it
    /// can only lower the key's class.
    #[schema(pattern = "^(auto|default|flex|scale|priority|interactive|batch)$")]
    service_tier: Option<String>,
    ignore_eos: Option<bool>,
    #[schema(minimum = 0)]
    min_tokens: Option<u32>,
    /// `false` opts out of speculative decoding.
    speculative: Option<bool>,
    #[schema(value_type = Option<Object>)]
    chat_template_kwargs: Option<Value>,
    user: Option<String>,
}

/// Token counts; `prompt_tokens_details.cached_tokens` are the prompt tokens served from
/// the prefix cache.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    #[schema(value_type = Option<Object>)]
    prompt_tokens_details: Option<Value>,
    #[schema(value_type = Option<Object>)]
    completion_tokens_details: Option<Value>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ChatChoice {
    index: u32,
    message: ChatMessage,
    /// `stop`, `length` or `tool_calls`.
    finish_reason: Option<String>,
    #[schema(value_type = Option<Object>)]
    logprobs: Option<Value>,
}

/// A chat completion (`stream: true` answers `text/event-stream` chunks of
/// `chat.completion.chunk`, then `data: [DONE]`).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ChatCompletion {
    id: String,
    /// `chat.completion`.
    object: String,
    created: i64,
    model: String,
    choices: Vec<ChatChoice>,
    usage: Usage,
}

/// `POST /v1/completions`: `prompt` is a string or token ids; `logprobs` an integer; the
/// other fields as in chat.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CompletionRequest {
    #[schema(min_length = 1)]
    model: String,
    prompt: Prompt,
    #[schema(minimum = 1)]
    max_tokens: Option<u32>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    temperature: Option<f64>,
    #[schema(minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    #[schema(minimum = -1)]
    top_k: Option<i64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    #[schema(minimum = 1, maximum = 16)]
    n: Option<u32>,
    /// Top alternatives per token, legacy format.
    #[schema(minimum = 0, maximum = 5)]
    logprobs: Option<u32>,
    stream: Option<bool>,
    #[schema(value_type = Option<Object>)]
    stream_options: Option<Value>,
    #[schema(max_length = 256)]
    prompt_cache_key: Option<String>,
    ignore_eos: Option<bool>,
    #[schema(minimum = 0)]
    min_tokens: Option<u32>,
    speculative: Option<bool>,
    user: Option<String>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CompletionChoice {
    index: u32,
    text: String,
    finish_reason: Option<String>,
    #[schema(value_type = Option<Object>)]
    logprobs: Option<Value>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct Completion {
    id: String,
    /// `text_completion`.
    object: String,
    created: i64,
    model: String,
    choices: Vec<CompletionChoice>,
    usage: Usage,
}

/// A Responses input: a string, or items (`{"role", "content"}` messages, `function_call`,
/// `function_call_output`, `reasoning`).
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum ResponseInput {
    Text(String),
    #[schema(value_type = Vec<Object>)]
    Items(Vec<Value>),
}

/// An Anthropic message: `content` is a string or blocks (`text`, `image`, `tool_use`,
/// `tool_result`, `thinking`).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct AnthropicMessage {
    /// `user` or `assistant`.
    #[schema(pattern = "^(user|assistant)$")]
    role: String,
    content: AnthropicContent,
}

/// A string, or content blocks.
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum AnthropicContent {
    Text(String),
    #[schema(value_type = Vec<Object>)]
    Blocks(Vec<Value>),
}

/// `POST /v1/responses` (OpenAI Responses): `input` is a string or an array of items
/// (messages, `function_call`, `function_call_output`, `reasoning`).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ResponseRequest {
    #[schema(min_length = 1)]
    model: String,
    input: ResponseInput,
    instructions: Option<String>,
    #[schema(minimum = 1)]
    max_output_tokens: Option<u32>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    temperature: Option<f64>,
    #[schema(minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    stream: Option<bool>,
    /// Keep the response for `previous_response_id` and `GET /v1/responses/{id}`
    /// (default true).
    store: Option<bool>,
    previous_response_id: Option<String>,
    #[schema(value_type = Option<Vec<Object>>)]
    tools: Option<Vec<Value>>,
    tool_choice: Option<ToolChoice>,
    parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    #[schema(value_type = Option<Object>)]
    text: Option<Value>,
    #[schema(value_type = Option<Object>)]
    reasoning: Option<Value>,
    prompt_cache_key: Option<String>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
}

/// A response object (`stream: true` answers `text/event-stream` with typed events,
/// `response.created` … `response.completed`).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ResponseObject {
    id: String,
    /// `response`.
    object: String,
    created_at: i64,
    /// `completed`, `incomplete` or `failed`.
    status: String,
    model: String,
    #[schema(value_type = Vec<Object>)]
    output: Vec<Value>,
    #[schema(value_type = Option<Object>)]
    usage: Option<Value>,
}

/// `POST /v1/messages` (Anthropic Messages).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct MessagesRequest {
    #[schema(min_length = 1)]
    model: String,
    #[schema(min_items = 1)]
    messages: Vec<AnthropicMessage>,
    /// An upper bound, cut to the room the prompt leaves.
    #[schema(minimum = 1)]
    max_tokens: u32,
    /// A string or text blocks.
    system: Option<AnthropicContent>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    temperature: Option<f64>,
    #[schema(minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    #[schema(minimum = -1)]
    top_k: Option<i64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    #[schema(value_type = Option<Vec<Object>>)]
    tools: Option<Vec<Value>>,
    #[schema(value_type = Option<Object>)]
    tool_choice: Option<Value>,
    #[schema(value_type = Option<Object>)]
    thinking: Option<Value>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
}

/// An Anthropic message (`stream: true` answers `text/event-stream` with
/// `message_start` … `message_stop`).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct MessageObject {
    id: String,
    /// `message`.
    r#type: String,
    /// `assistant`.
    role: String,
    model: String,
    /// `text`, `thinking` and `tool_use` blocks.
    #[schema(value_type = Vec<Object>)]
    content: Vec<Value>,
    stop_reason: Option<String>,
    stop_sequence: Option<String>,
    #[schema(value_type = Object)]
    usage: Value,
}

/// `POST /v1/messages/count_tokens`: the body of a Messages request (`max_tokens` may be
/// left out).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CountTokensRequest {
    #[schema(min_length = 1)]
    model: String,
    #[schema(min_items = 1)]
    messages: Vec<AnthropicMessage>,
    system: Option<AnthropicContent>,
    #[schema(value_type = Option<Vec<Object>>)]
    tools: Option<Vec<Value>>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub struct TokenCount {
    input_tokens: u64,
}

/// A served model.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct Model {
    id: String,
    /// `model`.
    object: String,
    created: i64,
    owned_by: String,
    context_length: u64,
    /// `warm`, `loading` or `cold` (models of a catalogue).
    state: Option<String>,
}

/// `GET /healthz`: the models served and their worker counts.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct Health {
    /// `ok`.
    status: String,
    #[schema(value_type = Vec<Object>)]
    models: Vec<Value>,
}

/// `GET /readyz` and `GET /livez`: `ready`/`ok`, or why not (`draining`, `database
/// unavailable` with `error`).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct Status {
    status: String,
    error: Option<String>,
    models: Option<u64>,
    workers: Option<u64>,
}

// ---- self-service and admin bodies -----------------------------------------------------

/// A new key; every field optional.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct KeyRequest {
    #[schema(min_length = 1)]
    name: Option<String>,
    /// `inference`, `manage` (default both; a tenant's key can grant no more than its own).
    scopes: Option<Vec<String>>,
    /// The models it may use (default every model).
    models: Option<Vec<String>>,
    /// Seconds from now (or `expires_at`, Unix ms; not both).
    #[schema(minimum = 1)]
    expires_in: Option<i64>,
    #[schema(minimum = 1)]
    expires_at: Option<i64>,
}

/// `{"name"}`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct TenantRequest {
    /// 1-64 printable characters, without surrounding spaces or the `tn_` prefix of ids.
    #[schema(min_length = 1, max_length = 64)]
    name: String,
}

/// `{"email", "role"}`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct InviteRequest {
    /// The invitee's e-mail address (stored lower-cased).
    email: String,
    role: hearth_tenants::members::Role,
}

/// `{"role"}`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct RoleRequest {
    role: hearth_tenants::members::Role,
}

/// A new invitation: its link is shown only here.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct CreatedInvitation {
    invitation: hearth_tenants::members::Invitation,
    /// The link's secret.
    token: String,
    /// The link to send: `<public URL>/dashboard/invite/<token>`; null when the gateway has
    /// no `--public-url` and the request was not addressed to localhost (links are not built
    /// from a client's `Host`).
    url: Option<String>,
}

/// `{"key_id": "…"}` attaches to one key; `{"key_id": null}` to the whole tenant.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct AttachmentRequest {
    key_id: Option<String>,
}

/// `{"monthly_usd": "12.50" | 12.5 | null, "mode": "hard" | "soft"}` (null or 0: none).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct BudgetRequest {
    /// Null, 0 or absent: no budget.
    monthly_usd: Option<Usd>,
    /// `hard` (default: refuse once spent) or `soft` (a warning header).
    #[schema(pattern = "^(hard|soft)$")]
    mode: Option<String>,
}

/// `{"tenant", "budget": {"monthly_usd", "mode"} | null}`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct BudgetView {
    tenant: String,
    #[schema(value_type = Option<Object>)]
    budget: Option<Value>,
}

/// `{"tenant", "limits"}` (or `{"key", "limits"}`).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct LimitsView {
    tenant: Option<String>,
    key: Option<String>,
    limits: hearth_tenants::Limits,
}

/// `{"model", "input", "cached_input", "output", "processor"?, "effective_from"?}`: USD per
/// million tokens (strings or numbers; `processor` per CPU-second), from Unix ms.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct PriceRequest {
    /// A model id, or `*` for every model without its own price.
    #[schema(min_length = 1, max_length = 128)]
    model: String,
    input: Usd,
    cached_input: Usd,
    output: Usd,
    /// Per CPU-second; absent: the model's current rate carries over.
    processor: Option<Usd>,
    /// What a batch's request pays, in percent of these rates (0–100); absent: the model's
    /// current share carries over (50 when it has none).
    #[schema(minimum = 0, maximum = 100)]
    batch_percent: Option<i64>,
    effective_from: Option<i64>,
}

/// `{"draining": true | false}` (empty body: true).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct DrainRequest {
    draining: Option<bool>,
}
