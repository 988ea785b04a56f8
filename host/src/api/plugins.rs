//! Plugin upload (admins for their tenant, operators to every tenant,
//! through `service::plugins`) and the paged listing of what the caller
//! may run.

use axum::extract::multipart::MultipartRejection;
use axum::extract::{Multipart, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::db;
use crate::db::audit::Actor;
use crate::run::manifest::Manifest;
use crate::service::plugins::{self as registry, COMPONENT_BYTES_MAX};

use super::paging::PageQuery;
use super::{ApiError, ApiQuery, AppState, Auth};

/// Plugins a listing page holds unless the caller asks for fewer.
pub const PLUGINS_PAGE_DEFAULT: usize = 100;
/// Bytes of an upload's `name` or `manifest` field.
const FIELD_BYTES_MAX: usize = 64 * 1024;

/// `POST /v1/plugins`, multipart: `name`, `component` (.wasm), optional `manifest` (JSON).
pub async fn upload(
    State(state): State<AppState>,
    Auth(p): Auth,
    form: Result<Multipart, MultipartRejection>,
) -> Result<impl IntoResponse, ApiError> {
    // Not multipart/form-data (or no boundary): the JSON error shape too.
    let mut form = form.map_err(|e| {
        ApiError::new(
            super::ErrorCode::UnsupportedMediaType,
            format!("the body must be multipart/form-data with a boundary: {}", e.body_text()),
        )
    })?;
    if !p.admin {
        return Err(ApiError::forbidden("uploading plugins needs an admin token"));
    }
    let sandbox = state.agents.sandbox().cloned().ok_or_else(|| ApiError::unavailable("this host runs no sandbox"))?;
    let (mut name, mut component, mut manifest, mut published) = (None, None, None, false);
    while let Some(field) =
        form.next_field().await.map_err(|e| ApiError::bad_request(format!("malformed multipart body: {e}")))?
    {
        let field_name = field.name().unwrap_or_default().to_string();
        let bytes = field.bytes().await.map_err(|e| match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::too_large(format!("the upload exceeds {COMPONENT_BYTES_MAX} bytes"))
            }
            _ => ApiError::bad_request(format!("malformed multipart body: {e}")),
        })?;
        if field_name != "component" && bytes.len() > FIELD_BYTES_MAX {
            return Err(ApiError::too_large(format!("field {field_name:?} exceeds {FIELD_BYTES_MAX} bytes")));
        }
        match field_name.as_str() {
            "name" => name = Some(String::from_utf8_lossy(&bytes).trim().to_string()),
            "component" => component = Some(bytes),
            "published" => {
                published = match String::from_utf8_lossy(&bytes).trim() {
                    "true" => true,
                    "false" => false,
                    other => return Err(ApiError::invalid(format!("published must be true or false, not {other:?}"))),
                }
            }
            "manifest" => {
                let v: Value = serde_json::from_slice(&bytes)
                    .map_err(|e| ApiError::invalid(format!("manifest is not JSON: {e}")))?;
                manifest = Some(v);
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown field {other:?}; send name, component, manifest, published"
                )))
            }
        }
    }
    let name = name.ok_or_else(|| ApiError::invalid("missing field `name`"))?;
    let manifest = manifest.unwrap_or_else(|| json!({}));
    // Name and manifest first: their refusals do not wait for the component.
    registry::check(&name, &manifest)?;
    let component = component.ok_or_else(|| ApiError::invalid("missing field `component` (the .wasm file)"))?;
    // A tenant's admin uploads for its tenant alone; only an operator publishes.
    if published && !p.operator {
        return Err(ApiError::forbidden("publishing a plugin to every tenant needs an operator token"));
    }
    let tenant = (!published).then_some(p.tenant_id.as_str());
    // A tenant's own plugin may be granted only what the operator grants
    // its tenant (the tools file's `tenants`); calls are checked again.
    if let Some(t) = tenant {
        let tools = state.agents.tools();
        let asked: Vec<&str> = manifest["tools"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        let refused: Vec<&str> = asked.into_iter().filter(|g| !tools.admits(g, t)).collect();
        if !refused.is_empty() {
            return Err(ApiError::invalid(format!(
                "the manifest grants tools the operator does not grant tenant {t:?}: {}",
                refused.join(", ")
            )));
        }
        // And may ask for no more than the tenant's ceilings.
        let limits = Manifest::parse(&manifest).map_err(ApiError::invalid)?.limits;
        let above = limits.above(&db::tenants::ceilings(&state.pool, t).await?);
        if !above.is_empty() {
            return Err(ApiError::invalid(format!(
                "the manifest asks for limits above tenant {t:?}'s ceilings: {}",
                above.join(", ")
            )));
        }
    }
    let actor = Actor::from(&p);
    let row = registry::register(&state.pool, &sandbox, &actor, tenant, &name, component.into(), &manifest).await?;
    let body = json!({ "name": row.name, "digest": row.digest, "language": row.language, "manifest": row.manifest, "tenant_id": row.tenant_id,
                       "published": row.tenant_id.is_none() });
    Ok((StatusCode::CREATED, Json(body)))
}

/// `GET /v1/plugins?limit&after`: the plugins the caller's tenant may run
/// (its own, then published ones; one per name) and the built-in agents
/// whose names no plugin took, one list in byte order of the name (the
/// cursor is the last name).
pub async fn list(
    State(state): State<AppState>,
    Auth(p): Auth,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let page = q.page(PLUGINS_PAGE_DEFAULT)?;
    let after = page.after.as_deref();
    let rows = db::plugins::list(&state.pool, Some(&p.tenant_id), after, page.fetch()).await?;
    let mut plugins: Vec<(String, Value)> = rows
        .into_iter()
        .map(|p| {
            let v = json!({ "name": p.name, "digest": p.digest, "language": p.language, "manifest": p.manifest,
                            "size_bytes": p.size_bytes, "updated_at": p.updated_at, "tenant_id": p.tenant_id,
                            "builtin": false });
            (p.name, v)
        })
        .collect();
    // A built-in past this page's registered names sorts past the cut below;
    // one within them was among the rows if a plugin took its name.
    for name in state.agents.names() {
        if after.is_none_or(|a| name.as_str() > a) && !plugins.iter().any(|(n, _)| *n == name) {
            let v = json!({ "name": name, "digest": null, "language": "built-in", "manifest": null, "builtin": true });
            plugins.push((name, v));
        }
    }
    plugins.sort_by(|a, b| a.0.cmp(&b.0));
    let next_cursor = page.finish(&mut plugins, |(name, _)| name.clone());
    let plugins: Vec<Value> = plugins.into_iter().map(|(_, v)| v).collect();
    Ok(Json(json!({ "plugins": plugins, "next_cursor": next_cursor })))
}
