//! What every handler extracts, written once: the caller ([`Auth`]), a JSON
//! body and a query with the API's error shape ([`ApiJson`], [`ApiQuery`]),
//! an id in the path ([`PathId`]: 400 naming what is not a UUID), and the
//! one not-found answer ([`OrNotFound`]: 404, the same for a missing object
//! and for another user's).

use std::fmt;

use axum::extract::{FromRef, FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::Json;

use crate::db::tokens::{self, Principal};
use crate::db::{ConversationId, RunId};

use super::{ApiError, AppState};

/// Bytes of a bearer token.
const TOKEN_BYTES_MAX: usize = 200;

/// The caller, from `Authorization: Bearer <token>`.
pub struct Auth(pub Principal);

impl<S> FromRequestParts<S> for Auth
where
    AppState: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let state = AppState::from_ref(state);
        let token = match parts.headers.get(axum::http::header::AUTHORIZATION) {
            Some(header) => header.to_str().ok().and_then(|h| h.strip_prefix("Bearer ")).map(str::trim),
            // A browser's EventSource cannot set headers: a run's stream
            // (only that route) also takes the token as `access_token`.
            None if parts.uri.path().ends_with("/events") => stream_token(parts.uri.query()),
            None => return Err(ApiError::unauthenticated("missing Authorization: Bearer <token>")),
        };
        let token = token
            .filter(|t| !t.is_empty() && t.len() <= TOKEN_BYTES_MAX)
            .ok_or_else(|| ApiError::unauthenticated("Authorization must be `Bearer <token>`"))?;
        match tokens::authenticate(&state.pool, token).await? {
            Some(p) => Ok(Auth(p)),
            None => Err(ApiError::unauthenticated("unknown token")),
        }
    }
}

/// The `access_token` query parameter (tokens are URL-safe: `ah_` and hex).
fn stream_token(query: Option<&str>) -> Option<&str> {
    query?.split('&').find_map(|pair| pair.strip_prefix("access_token="))
}

/// An axum extractor whose rejections use the API's error shape: the
/// wrapper, the extractor it wraps, the trait, its method and what it reads.
macro_rules! api_extractor {
    ($(#[$doc:meta])* $wrapper:ident($inner:ident), $trait_:ident, $method:ident, $input:ty, $rejection:ty) => {
        $(#[$doc])*
        pub struct $wrapper<T>(pub T);

        impl<T, S> $trait_<S> for $wrapper<T>
        where
            $inner<T>: $trait_<S, Rejection = $rejection>,
            S: Send + Sync,
        {
            type Rejection = ApiError;

            async fn $method(input: $input, state: &S) -> Result<Self, Self::Rejection> {
                Ok($wrapper($inner::<T>::$method(input, state).await?.0))
            }
        }
    };
}

api_extractor!(
    /// `Json` whose rejections use the API's error shape and statuses.
    ApiJson(Json), FromRequest, from_request, Request, axum::extract::rejection::JsonRejection
);
api_extractor!(
    /// `Query` whose rejections use the API's error shape (400).
    ApiQuery(Query), FromRequestParts, from_request_parts, &mut Parts, axum::extract::rejection::QueryRejection
);

/// A kind of object addressed by id in a path.
pub trait Resource: std::str::FromStr + fmt::Display + Copy + Send {
    /// How messages name it: `run`, `conversation`.
    const NAME: &'static str;
}

impl Resource for RunId {
    const NAME: &'static str = "run";
}

impl Resource for ConversationId {
    const NAME: &'static str = "conversation";
}

/// The `{id}` of a path, parsed: a malformed one is a 400 that names what
/// was expected (`run id "x" is not a UUID`). Displays as `run <id>`.
#[derive(Debug, Clone, Copy)]
pub struct PathId<T>(pub T);

impl<T: Resource> fmt::Display for PathId<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", T::NAME, self.0)
    }
}

impl<T: Resource, S: Send + Sync> FromRequestParts<S> for PathId<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(raw) =
            Path::<String>::from_request_parts(parts, state).await.map_err(|e| ApiError::bad_request(e.body_text()))?;
        raw.parse().map(PathId).map_err(|_| ApiError::bad_request(format!("{} id {raw:?} is not a UUID", T::NAME)))
    }
}

/// The one not-found answer: missing and someone else's look the same.
pub trait OrNotFound<T> {
    fn or_not_found(self, what: impl fmt::Display) -> Result<T, ApiError>;
}

impl<T> OrNotFound<T> for Option<T> {
    fn or_not_found(self, what: impl fmt::Display) -> Result<T, ApiError> {
        self.ok_or_else(|| ApiError::not_found(what))
    }
}
