//! What the two JSON-RPC endpoints (`a2a`, `mcp`) share: JSON-RPC's error
//! codes, the error a handler returns (a JSON-RPC error, answered 200, or
//! one of HTTP's own: 401, 403, 429, 503, answered with that status in the
//! API's error shape so clients retry what is retryable), and its mapping
//! from the API's errors.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::{ApiError, ErrorCode};

pub(super) const PARSE_ERROR: i64 = -32700;
pub(super) const INVALID_REQUEST: i64 = -32600;
pub(super) const METHOD_NOT_FOUND: i64 = -32601;
pub(super) const INVALID_PARAMS: i64 = -32602;
pub(super) const INTERNAL_ERROR: i64 = -32603;

#[derive(Debug)]
pub(super) enum RpcError {
    Rpc { code: i64, message: String },
    Http(ApiError),
}

impl RpcError {
    pub(super) fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError::Rpc { code, message: message.into() }
    }
}

impl From<ApiError> for RpcError {
    fn from(e: ApiError) -> Self {
        let code = match e.code {
            ErrorCode::BadRequest
            | ErrorCode::Invalid
            | ErrorCode::TooLarge
            | ErrorCode::Conflict
            | ErrorCode::ConversationBusy
            | ErrorCode::IdempotencyKeyReused
            | ErrorCode::NotFound => INVALID_PARAMS,
            ErrorCode::Forbidden
            | ErrorCode::Unauthenticated
            | ErrorCode::QuotaExceeded
            | ErrorCode::TooManyStreams
            | ErrorCode::Unavailable => return RpcError::Http(e),
            _ => INTERNAL_ERROR,
        };
        RpcError::Rpc { code, message: e.message }
    }
}

impl From<sqlx::Error> for RpcError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::from(e).into()
    }
}

impl From<crate::stream::tail::TailError> for RpcError {
    fn from(e: crate::stream::tail::TailError) -> Self {
        ApiError::from(e).into()
    }
}

impl From<crate::stream::tail::TooManyTails> for RpcError {
    fn from(e: crate::stream::tail::TooManyTails) -> Self {
        ApiError::from(e).into()
    }
}

/// An HTTP error in the API's shape; a 401 with its `Bearer` challenge.
pub(super) fn http_error(e: ApiError) -> Response {
    let unauthenticated = e.code == ErrorCode::Unauthenticated;
    let mut res = e.into_response();
    if unauthenticated {
        res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    res
}

/// A JSON-RPC error object answering request `id`.
pub(super) fn rpc_error(id: &Value, code: i64, message: &str) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } })
}
