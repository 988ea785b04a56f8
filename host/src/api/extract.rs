//! What every handler extracts, written once: the caller ([`Auth`], or an
//! admin: [`Admin`]), a JSON
//! body and a query with the API's error shape ([`ApiJson`], [`ApiQuery`]),
//! an id in the path ([`PathId`]: 400 naming what is not a UUID), and the
//! one not-found answer ([`OrNotFound`]: 404, the same for a missing object
//! and for another user's).

use std::fmt;

use axum::extract::{FromRef, FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::Json;

use crate::db::tokens::{self, Principal, TokenId};
use crate::db::{ConversationId, RunId};

use super::{ApiError, AppState};

/// Bytes of a bearer token.
const TOKEN_BYTES_MAX: usize = 200;

/// The caller, from `Authorization: Bearer <token>`, or on a run's event
/// stream (only there) from `?ticket=`: a short-lived ticket for that run
/// alone, minted by `POST /v1/runs/{id}/stream-ticket`, since a browser's
/// EventSource cannot send headers. A long-lived token is never taken from
/// a URL (`?access_token=` is refused). Every request reads the token's row:
/// a revoked or expired one is refused by every process at once.
pub struct Auth(pub Principal);

impl<S> FromRequestParts<S> for Auth
where
    AppState: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let state = AppState::from_ref(state);
        let query = parts.uri.query();
        if query_param(query, "access_token").is_some() {
            return Err(ApiError::unauthenticated(
                "a token in a URL is refused; send Authorization: Bearer <token>, or for an EventSource a stream \
                 ticket (POST /v1/runs/{id}/stream-ticket, then ?ticket=)",
            ));
        }
        let header = parts.headers.get(axum::http::header::AUTHORIZATION);
        if header.is_none() {
            if let (Some(ticket), Some(run)) = (query_param(query, "ticket"), stream_run(parts.uri.path())) {
                let ticket = Some(ticket)
                    .filter(|t| !t.is_empty() && t.len() <= TOKEN_BYTES_MAX)
                    .ok_or_else(|| ApiError::unauthenticated("malformed stream ticket"))?;
                return match tokens::authenticate_ticket(&state.pool, ticket, run).await? {
                    Some(p) => Ok(Auth(p)),
                    None => Err(ApiError::unauthenticated("unknown or expired stream ticket for this run")),
                };
            }
            return Err(ApiError::unauthenticated("missing Authorization: Bearer <token>"));
        }
        let token = header
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty() && t.len() <= TOKEN_BYTES_MAX)
            .ok_or_else(|| ApiError::unauthenticated("Authorization must be `Bearer <token>`"))?;
        match tokens::authenticate(&state.pool, token).await? {
            Some(p) => Ok(Auth(p)),
            None => Err(ApiError::unauthenticated("unknown, expired or revoked token")),
        }
    }
}

/// A query parameter's raw value (tickets and tokens are URL-safe: a
/// prefix and hex).
fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?.split('&').find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
}

/// The run of `/v1/runs/{id}/events`, the one route a ticket opens.
fn stream_run(path: &str) -> Option<RunId> {
    path.strip_prefix("/v1/runs/")?.strip_suffix("/events")?.parse().ok()
}

/// An admin of some tenant, or refused (403).
pub struct Admin(pub Principal);

impl<S> FromRequestParts<S> for Admin
where
    AppState: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Auth(p) = Auth::from_request_parts(parts, state).await?;
        if !p.admin {
            return Err(ApiError::forbidden("this needs an admin token"));
        }
        Ok(Admin(p))
    }
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

impl Resource for TokenId {
    const NAME: &'static str = "token";
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
