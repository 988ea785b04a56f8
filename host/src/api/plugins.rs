//! Plugin upload (admins) and listing.

use axum::extract::{Multipart, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::db;
use crate::sandbox::Manifest;

use super::{ApiError, AppState, Auth};

/// Bytes of an uploaded component.
pub const COMPONENT_BYTES_MAX: usize = 32 << 20;

/// `POST /v1/plugins`, multipart: `name`, `component` (.wasm), optional `manifest` (JSON).
pub async fn upload(
    State(state): State<AppState>,
    Auth(p): Auth,
    mut form: Multipart,
) -> Result<impl IntoResponse, ApiError> {
    if !p.admin {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", "uploading plugins needs an admin token"));
    }
    let sandbox = state.agents.sandbox().cloned().ok_or_else(|| ApiError::unavailable("this host runs no sandbox"))?;
    let (mut name, mut component, mut manifest) = (None, None, None);
    while let Some(field) =
        form.next_field().await.map_err(|e| ApiError::bad_request(format!("malformed multipart body: {e}")))?
    {
        let field_name = field.name().unwrap_or_default().to_string();
        let bytes = field.bytes().await.map_err(|e| match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("the upload exceeds {COMPONENT_BYTES_MAX} bytes"),
            ),
            _ => ApiError::bad_request(format!("malformed multipart body: {e}")),
        })?;
        match field_name.as_str() {
            "name" => name = Some(String::from_utf8_lossy(&bytes).trim().to_string()),
            "component" => component = Some(bytes),
            "manifest" => {
                let v: Value = serde_json::from_slice(&bytes)
                    .map_err(|e| ApiError::invalid(format!("manifest is not JSON: {e}")))?;
                manifest = Some(v);
            }
            other => return Err(ApiError::invalid(format!("unknown field {other:?}; send name, component, manifest"))),
        }
    }
    let name = name.ok_or_else(|| ApiError::invalid("missing field `name`"))?;
    if !db::plugins::valid_name(&name) {
        return Err(ApiError::invalid(format!(
            "plugin name {name:?} must be 1-63 characters of a-z, 0-9, _ and -, starting with a letter"
        )));
    }
    let component = component.ok_or_else(|| ApiError::invalid("missing field `component` (the .wasm file)"))?;
    let manifest = manifest.unwrap_or_else(|| json!({}));
    Manifest::parse(&manifest).map_err(ApiError::invalid)?;
    // Compiling is CPU work: off the async threads.
    let bytes = component.clone();
    tokio::task::spawn_blocking(move || sandbox.validate(&bytes))
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let row = db::plugins::put(&state.pool, &name, &component, &manifest).await?;
    Ok((StatusCode::CREATED, Json(json!({ "name": row.name, "digest": row.digest, "manifest": row.manifest }))))
}

/// `GET /v1/plugins`.
pub async fn list(State(state): State<AppState>, Auth(_): Auth) -> Result<impl IntoResponse, ApiError> {
    let mut plugins: Vec<Value> = db::plugins::list(&state.pool)
        .await?
        .into_iter()
        .map(|p| {
            json!({ "name": p.name, "digest": p.digest, "manifest": p.manifest,
                    "size_bytes": p.size_bytes, "updated_at": p.updated_at, "builtin": false })
        })
        .collect();
    for name in state.agents.names() {
        if !plugins.iter().any(|p| p["name"] == name.as_str()) {
            plugins.push(json!({ "name": name, "digest": null, "manifest": null, "builtin": true }));
        }
    }
    Ok(Json(json!({ "plugins": plugins })))
}
