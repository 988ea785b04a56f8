//! One error type for every route: `{"error": {"code", "message"}}`, the code
//! one of [`ErrorCode`] and the status the code's. The services' typed errors
//! are mapped here, once. Database and other internal errors are logged with
//! their cause and answered with a fixed message: no SQL or driver text ever
//! reaches a client.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::service::plugins::RegisterError;
use crate::service::quota::QuotaExceeded;
use crate::service::submit::SubmitError;
use crate::stream::tail::{TailError, TooManyTails};

/// Every error code the API answers, with its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// 400: a malformed body, id, query or header.
    BadRequest,
    /// 401: no token, or an unknown one.
    Unauthenticated,
    /// 403: a valid token that may not do this.
    Forbidden,
    /// 404: unknown, or someone else's.
    NotFound,
    /// 405: a known path, another method.
    MethodNotAllowed,
    /// 409: conflicts with the current state.
    Conflict,
    /// 409: an idempotency key already used for another request.
    IdempotencyKeyReused,
    /// 409: `multitask_strategy: reject`, and the conversation has an active
    /// turn (the message names it).
    ConversationBusy,
    /// 413.
    TooLarge,
    /// 415.
    UnsupportedMediaType,
    /// 422: well-formed but not acceptable.
    Invalid,
    /// 500: a fault of ours, logged; the message is fixed.
    Internal,
    /// 503: the database or a part of the host is not available.
    Unavailable,
    /// 503: the process serves as many live streams as it may; retry after.
    TooManyStreams,
    /// 429: past a tenant's or user's quota or rate; retry after.
    QuotaExceeded,
}

impl ErrorCode {
    pub const ALL: &'static [ErrorCode] = &[
        ErrorCode::BadRequest,
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::Conflict,
        ErrorCode::IdempotencyKeyReused,
        ErrorCode::ConversationBusy,
        ErrorCode::TooLarge,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::Invalid,
        ErrorCode::Internal,
        ErrorCode::Unavailable,
        ErrorCode::TooManyStreams,
        ErrorCode::QuotaExceeded,
    ];

    /// The wire form, stable.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Conflict => "conflict",
            ErrorCode::IdempotencyKeyReused => "idempotency_key_reused",
            ErrorCode::ConversationBusy => "conversation_busy",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::Invalid => "invalid",
            ErrorCode::Internal => "internal",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::TooManyStreams => "too_many_streams",
            ErrorCode::QuotaExceeded => "quota_exceeded",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::BadRequest => StatusCode::BAD_REQUEST,
            ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
            ErrorCode::Forbidden => StatusCode::FORBIDDEN,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::Conflict | ErrorCode::IdempotencyKeyReused | ErrorCode::ConversationBusy => StatusCode::CONFLICT,
            ErrorCode::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::Invalid => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Unavailable | ErrorCode::TooManyStreams => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
        }
    }
}

/// Seconds a client refused for too many streams is told to wait.
pub const STREAMS_RETRY_AFTER_S: u32 = 5;

#[derive(Debug)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    /// `Retry-After`, in seconds.
    pub retry_after_s: Option<u32>,
}

/// `ApiError::invalid(message)` and its siblings: one per code a handler names.
macro_rules! constructors {
    ($($name:ident => $code:ident),+ $(,)?) => {
        $(pub fn $name(message: impl Into<String>) -> Self {
            Self::new(ErrorCode::$code, message)
        })+
    };
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError { code, message: message.into(), retry_after_s: None }
    }
    pub fn status(&self) -> StatusCode {
        self.code.status()
    }
    pub fn not_found(what: impl std::fmt::Display) -> Self {
        Self::new(ErrorCode::NotFound, format!("{what} not found"))
    }
    constructors! {
        invalid => Invalid,
        bad_request => BadRequest,
        unauthenticated => Unauthenticated,
        forbidden => Forbidden,
        conflict => Conflict,
        too_large => TooLarge,
        unavailable => Unavailable,
    }
    /// The internal path: `cause` goes to the log, the client gets a fixed message.
    pub fn internal(cause: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(ErrorCode::Internal, "internal error")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "code": self.code.as_str(), "message": self.message } });
        let mut res = (self.code.status(), Json(body)).into_response();
        if let Some(s) = self.retry_after_s {
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        res
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(d) = &e {
            if d.constraint().is_some() && d.is_unique_violation() {
                tracing::info!(error = %e, "conflict");
                return ApiError::conflict("the request conflicts with the current state");
            }
        }
        match e {
            sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed => {
                tracing::warn!(error = %e, "database unavailable");
                ApiError::unavailable("the database is unavailable; retry shortly")
            }
            e => ApiError::internal(&e),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match r {
            JsonRejection::JsonDataError(e) => ApiError::invalid(e.body_text()),
            JsonRejection::JsonSyntaxError(e) => ApiError::bad_request(e.body_text()),
            JsonRejection::MissingJsonContentType(_) => ApiError::new(
                ErrorCode::UnsupportedMediaType,
                "send the body as JSON with Content-Type: application/json",
            ),
            JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::too_large(e.body_text())
            }
            other => ApiError::bad_request(other.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::bad_request(r.body_text())
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        let message = e.to_string();
        match e {
            SubmitError::Unstorable(_)
            | SubmitError::EmptyContent
            | SubmitError::ContentTooLong(_)
            | SubmitError::UnknownPlugin { .. }
            | SubmitError::ConfigNotObject
            | SubmitError::ConfigTooLarge(_)
            | SubmitError::WebhookNotAllowed(_) => ApiError::invalid(message),
            SubmitError::Busy { .. } => ApiError::new(ErrorCode::ConversationBusy, message),
            SubmitError::BadIdempotencyKey => ApiError::bad_request(message),
            SubmitError::ConversationNotFound(_) => ApiError::new(ErrorCode::NotFound, message),
            SubmitError::IdempotencyKeyReused { .. } => ApiError::new(ErrorCode::IdempotencyKeyReused, message),
            SubmitError::IdempotencyKeyInUse => ApiError::conflict(message),
            SubmitError::Quota(q) => q.into(),
            SubmitError::Db(e) => e.into(),
        }
    }
}

impl From<RegisterError> for ApiError {
    fn from(e: RegisterError) -> Self {
        let message = e.to_string();
        match e {
            RegisterError::Unstorable(_)
            | RegisterError::InvalidName(_)
            | RegisterError::InvalidManifest(_)
            | RegisterError::InvalidComponent(_) => ApiError::invalid(message),
            RegisterError::TooLarge(_) => ApiError::too_large(message),
            RegisterError::Interrupted => ApiError::unavailable(message),
            RegisterError::Db(e) => e.into(),
        }
    }
}

impl From<TailError> for ApiError {
    fn from(e: TailError) -> Self {
        match e {
            TailError::Db(e) => e.into(),
            TailError::Stalled { .. } => ApiError::unavailable(e.to_string()),
        }
    }
}

impl From<QuotaExceeded> for ApiError {
    fn from(q: QuotaExceeded) -> Self {
        ApiError { code: ErrorCode::QuotaExceeded, message: q.message, retry_after_s: Some(q.retry_after_s) }
    }
}

impl From<TooManyTails> for ApiError {
    fn from(e: TooManyTails) -> Self {
        ApiError {
            code: ErrorCode::TooManyStreams,
            message: format!("{e}; retry in a few seconds"),
            retry_after_s: Some(STREAMS_RETRY_AFTER_S),
        }
    }
}
