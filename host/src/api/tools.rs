//! `GET /v1/tools`: the host tools the caller's tenant may grant its plugins
//! and call, listed as a guest granted all of them would see them
//! (`ToolRegistry::available`, over the same listing `list-tools` answers).

use axum::extract::State;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use super::paging::PageQuery;
use super::{ApiError, ApiQuery, AppState, Auth};

/// Tools a listing page holds unless the caller asks for fewer.
pub const TOOLS_PAGE_DEFAULT: usize = 1000;

/// `GET /v1/tools?limit&after`: by name (the cursor is the last name); an
/// MCP server that cannot be listed now is named in `unavailable` on every
/// page, its tools absent until it answers.
pub async fn list(
    State(state): State<AppState>,
    Auth(p): Auth,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let page = q.page(TOOLS_PAGE_DEFAULT)?;
    let registry = state.agents.tools();
    let (tools, unavailable) = registry.available(&p.tenant_id).await;
    let mut tools: Vec<_> =
        tools.into_iter().filter(|t| page.after.as_deref().is_none_or(|a| t.name.as_str() > a)).collect();
    let next_cursor = page.finish(&mut tools, |t| t.name.clone());
    let tools: Vec<Value> = tools
        .into_iter()
        .map(|t| {
            json!({ "name": t.name, "kind": registry.kind_of(&t.name), "description": t.description,
                    "input_schema": t.input_schema })
        })
        .collect();
    Ok(Json(json!({ "tools": tools, "unavailable": unavailable, "next_cursor": next_cursor })))
}
