//! Approvals: the caller's pending ones, and a decision on one (which puts
//! the waiting run back in the queue, once).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::suspensions::{self, DecideError, Decision, PENDING_PAGE_MAX};
use crate::db::{Reach, RunId};
use crate::text;

use super::paging::PageQuery;
use super::{ApiError, ApiJson, ApiQuery, AppState, Auth};

/// The runs whose approvals `p` may decide: its own; an admin's, its tenant's.
fn reach(p: &crate::db::tokens::Principal) -> Reach<'_> {
    match (p.admin, p.tenant_scope()) {
        (false, _) => Reach::Owner(&p.user_id),
        (true, Some(tenant)) => Reach::Tenant(tenant),
        (true, None) => Reach::All,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalsQuery {
    limit: Option<String>,
    after: Option<String>,
    /// `true`: an admin's view, its tenant's pending approvals.
    all: Option<String>,
}

/// A reason's length, at most.
const REASON_CHARS_MAX: usize = 2000;

/// `GET /v1/approvals?limit&after`: the caller's pending approvals, oldest first.
pub async fn list_approvals(
    State(state): State<AppState>,
    Auth(p): Auth,
    ApiQuery(q): ApiQuery<ApprovalsQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let page = PageQuery::new(q.limit.clone(), q.after.clone()).page(PENDING_PAGE_MAX as usize)?;
    let after = match page.after_as::<String>()? {
        None => None,
        Some(key) => {
            let bad = || ApiError::bad_request("after must be a next_cursor this list answered");
            let (run, call) = key.split_once(':').ok_or_else(bad)?;
            Some((run.parse::<RunId>().map_err(|_| bad())?, call.parse::<i32>().map_err(|_| bad())?))
        }
    };
    let reach = match q.all.as_deref() {
        None | Some("false") => Reach::Owner(&p.user_id),
        Some("true") if p.admin => reach(&p),
        Some("true") => return Err(ApiError::forbidden("all=true lists a tenant's approvals: admin tokens only")),
        Some(other) => return Err(ApiError::bad_request(format!("all must be true or false, not {other:?}"))),
    };
    let mut rows = suspensions::pending(&state.pool, reach, page.fetch(), after).await?;
    let next_cursor = page.finish(&mut rows, |a| format!("{}:{}", a.run_id, a.call_id));
    Ok(Json(json!({ "approvals": rows, "next_cursor": next_cursor })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionBody {
    decision: String,
    #[serde(default)]
    args: Option<Value>,
    #[serde(default)]
    reason: Option<String>,
}

/// `POST /v1/runs/{id}/approvals/{call_id}` `{decision: approve|reject|edit,
/// args?, reason?}`: recorded once, with the run re-queued in the same
/// transaction; a second decision answers 409 with the first.
pub async fn decide(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path((run, call)): Path<(String, String)>,
    ApiJson(body): ApiJson<DecisionBody>,
) -> Result<Response, ApiError> {
    let run: RunId = run.parse().map_err(|_| ApiError::bad_request(format!("run id {run:?} is not a UUID")))?;
    let call: i32 = call
        .parse()
        .ok()
        .filter(|c| *c >= 1)
        .ok_or_else(|| ApiError::bad_request(format!("call id {call:?} is not a tool call's number")))?;
    match (body.decision.as_str(), &body.args) {
        ("approve" | "reject", None) => {}
        ("edit", Some(Value::Object(_))) => {}
        ("edit", _) => return Err(ApiError::invalid("an edit needs args, a JSON object the call runs with")),
        ("approve" | "reject", Some(_)) => return Err(ApiError::invalid("only an edit takes args")),
        (other, _) => {
            return Err(ApiError::invalid(format!("decision must be approve, reject or edit, not {other:?}")))
        }
    }
    let unstorable = |e: text::Unstorable| ApiError::invalid(e.to_string());
    if let Some(args) = &body.args {
        text::refuse_json("args", args).map_err(unstorable)?;
    }
    if let Some(reason) = &body.reason {
        text::refuse_text("reason", reason).map_err(unstorable)?;
        if reason.chars().count() > REASON_CHARS_MAX {
            return Err(ApiError::invalid(format!("reason is at most {REASON_CHARS_MAX} characters")));
        }
    }
    let reason = match (body.decision.as_str(), body.reason.as_deref()) {
        ("reject", None) => Some("rejected by the approver"),
        (_, r) => r,
    };
    match decide_call(&state, &p, run, call, &body.decision, body.args.as_ref(), reason).await? {
        Decided::Now(view) => {
            Ok((StatusCode::OK, Json(json!({ "run_id": run, "status": "queued", "decision": view }))).into_response())
        }
        Decided::Already(first) => {
            let error =
                json!({ "code": "conflict", "message": format!("approval {call} of run {run} was decided already") });
            Ok((StatusCode::CONFLICT, Json(json!({ "error": error, "decision": first }))).into_response())
        }
    }
}

/// What a decision did.
pub(super) enum Decided {
    /// Recorded: the run is back in the queue.
    Now(Value),
    /// The call had been decided already: the first decision.
    Already(Value),
}

/// A decision on call `call` of `run` by `p` (checked: `decision` is
/// approve, reject or edit, `args` an edit's object): who may decide is the
/// requester or an admin of its tenant, and for a call the operator gates,
/// as the operator says (`ApprovalPolicy`). Audited. Every API that decides
/// (the native route, A2A) decides through this.
pub(super) async fn decide_call(
    state: &AppState,
    p: &crate::db::tokens::Principal,
    run: RunId,
    call: i32,
    decision: &str,
    args: Option<&Value>,
    reason: Option<&str>,
) -> Result<Decided, ApiError> {
    let (requester, tool) = suspensions::approval_call(&state.pool, run, call, reach(p))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("approval {call} of run {run}")))?;
    let gated = state.agents.tools().get(&tool).is_some_and(|t| t.requires_approval());
    let rules = &state.policy.approvals;
    if gated && rules.admin_decides && (requester == p.user_id || !p.admin) {
        return Err(ApiError::forbidden(format!(
            "the operator gates tool {tool:?}: an admin of the tenant other than the requester decides its calls"
        )));
    }
    if gated && !rules.edit && decision == "edit" {
        return Err(ApiError::forbidden(format!("the operator gates tool {tool:?}: its calls may not be edited")));
    }
    let d = Decision { decision, args, reason, decided_by: &p.user_id };
    match suspensions::decide(&state.pool, run, reach(p), call, &d).await {
        Ok(view) => {
            // The decision and the call, never its arguments or reason (free text).
            let detail = json!({ "call_id": call, "decision": decision });
            let target = format!("{run}/{call}");
            super::audit::record(state, p, crate::db::audit::action::APPROVAL_DECIDED, target, detail).await;
            Ok(Decided::Now(json!(view)))
        }
        Err(DecideError::NotFound) => Err(ApiError::not_found(format!("approval {call} of run {run}"))),
        Err(DecideError::Decided(first)) => Ok(Decided::Already(json!(first))),
        Err(DecideError::NotWaiting(m)) => Err(ApiError::conflict(m)),
        Err(DecideError::Db(e)) => Err(e.into()),
    }
}
