//! `GET /v1/webhooks/signing-key`: the key a tenant's completion webhooks
//! are signed with (admins, for their tenant; derived from the operator's
//! secret, `worker::webhook_tenant_key`), in the Standard Webhooks form.

use axum::extract::State;
use axum::response::IntoResponse;
use axum::Json;
use base64::Engine;
use serde_json::json;

use super::{Admin, ApiError, AppState};

pub async fn signing_key(State(state): State<AppState>, Admin(p): Admin) -> Result<impl IntoResponse, ApiError> {
    let secret = state
        .policy
        .webhook_secret
        .as_ref()
        .ok_or_else(|| ApiError::not_found("a webhook signing key (this host sends no webhooks)"))?;
    let key = crate::worker::webhook_tenant_key(&secret.0, &p.tenant_id);
    let key = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(key));
    Ok(Json(json!({ "tenant_id": p.tenant_id, "key": key })))
}
