//! How a run ends, decided once. The run task races the agent against the
//! host's reasons to stop it (a lost claim, an abort, a stop past its grace,
//! a drain, the wall time, a journal that cannot be written); [`settle`]
//! takes what won that race and one snapshot of the host's verdict and
//! returns the ending. It is pure: the table test below walks every
//! combination. The order, first match wins:
//!
//! 1. a run that suspended itself waits (its claim is cleared on purpose);
//! 2. a lost claim, or an agent refused `fenced`, writes nothing more;
//! 3. a drain out of budget hands a resumable run back (unless stopped);
//! 4. the host's own failure (a limit, a divergent replay) overrides what
//!    the agent returned;
//! 5. a requested stop ends the run cancelled, whatever the agent said (an
//!    answer it returned anyway is kept as the partial text); a stop that
//!    had to interrupt the run says so;
//! 6. otherwise the run ends as the agent (or the race) said.

use crate::agent::{AgentError, FailReason, HostError};
use crate::db::{MessageStatus, RunStatus};

/// What ended the race of a run task.
#[derive(Debug, Clone, PartialEq)]
pub enum Race {
    /// The agent returned.
    Returned(Result<String, AgentError>),
    /// The host aborted the run: a suspension, or its failure.
    Aborted,
    /// The claim went (heartbeat or journal found it gone).
    Lost,
    /// A stop was not honoured within the grace (ms): interrupted.
    Forced(u64),
    /// The host shut down with the run still going, its drain budget spent.
    ShutDown,
    /// The manifest's wall time (ms) passed, for an agent that does not keep it itself.
    Wall(u64),
    /// The run's journal could not be written for too long.
    JournalGaveUp,
}

/// The host's side of the run as the race ended.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Verdict {
    /// The run suspended itself (an approval, a wait).
    pub suspended: bool,
    /// The host failed it: a limit, or a replay that diverged.
    pub failure: Option<AgentError>,
    /// A stop was requested.
    pub stop_requested: bool,
    /// The pinned manifest says the run is resumable.
    pub resumable: bool,
}

/// What the run task does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    Suspended,
    Lost,
    HandBack,
    End(End),
}

/// A terminal ending, before the journal is closed.
#[derive(Debug, Clone, PartialEq)]
pub struct End {
    pub status: RunStatus,
    pub error: Option<String>,
    /// Why a failed run failed.
    pub reason: Option<FailReason>,
    /// The answer of a completed run, or one the agent returned after a stop.
    pub answer: Option<String>,
}

/// The ending of a run task's race: see the module's doc for the order.
pub fn settle(race: Race, v: &Verdict) -> Settled {
    if v.suspended {
        return Settled::Suspended;
    }
    let result = match race {
        Race::Lost | Race::Returned(Err(AgentError::Host(HostError::Fenced))) => return Settled::Lost,
        Race::ShutDown if v.resumable && !v.stop_requested => return Settled::HandBack,
        Race::ShutDown => {
            Err(AgentError::failed(FailReason::DrainTimeout, "the host shut down before the run finished"))
        }
        Race::Forced(grace_ms) => Err(AgentError::Interrupted(grace_ms)),
        Race::Wall(ms) => Err(AgentError::failed(FailReason::Limit, format!("wall time of {ms} ms exceeded"))),
        Race::JournalGaveUp => Err(AgentError::failed(
            FailReason::Host,
            "the run's journal could not be written: the database was unreachable too long",
        )),
        Race::Aborted | Race::Returned(_) if v.failure.is_some() => Err(v.failure.clone().expect("checked")),
        Race::Aborted => Err(AgentError::failed(FailReason::Host, "the run was aborted")),
        Race::Returned(r) => r,
    };
    if v.stop_requested {
        return Settled::End(match result {
            Ok(answer) => End { answer: Some(answer), ..cancelled(None) },
            Err(e @ AgentError::Interrupted(_)) => cancelled(Some(e.to_string())),
            Err(_) => cancelled(None),
        });
    }
    Settled::End(ended(result))
}

/// The ending a result says, with no stop in the way (also the ending of a
/// run that could not start, or was handed back with no attempts left).
pub fn ended(result: Result<String, AgentError>) -> End {
    match result {
        Ok(answer) => End { status: RunStatus::Completed, error: None, reason: None, answer: Some(answer) },
        Err(AgentError::Host(HostError::Cancelled)) => cancelled(None),
        Err(e @ AgentError::Interrupted(_)) => cancelled(Some(e.to_string())),
        Err(e) => End { status: RunStatus::Failed, error: Some(e.to_string()), reason: Some(e.reason()), answer: None },
    }
}

fn cancelled(error: Option<String>) -> End {
    End { status: RunStatus::Cancelled, error, reason: None, answer: None }
}

impl End {
    /// The assistant message the ending stores: a completed run's answer; a
    /// cancelled or failed run's streamed text as partial (or, when nothing
    /// streamed, an answer returned after a stop); none when there is no text.
    pub fn assistant(&self, streamed: String) -> Option<(String, MessageStatus)> {
        if self.status == RunStatus::Completed {
            return self.answer.clone().map(|a| (a, MessageStatus::Complete));
        }
        let text = match streamed.is_empty() {
            true => self.answer.clone().unwrap_or_default(),
            false => streamed,
        };
        (!text.is_empty()).then_some((text, MessageStatus::Partial))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit() -> AgentError {
        AgentError::failed(FailReason::Limit, "events: 10 exceeded")
    }

    fn races() -> Vec<Race> {
        vec![
            Race::Returned(Ok("hi".into())),
            Race::Returned(Err(AgentError::failed(FailReason::Plugin, "boom"))),
            Race::Returned(Err(AgentError::Host(HostError::Cancelled))),
            Race::Returned(Err(AgentError::Host(HostError::Fenced))),
            Race::Aborted,
            Race::Lost,
            Race::Forced(500),
            Race::ShutDown,
            Race::Wall(1000),
            Race::JournalGaveUp,
        ]
    }

    /// The expected ending of every (race, verdict) pair, written out from
    /// the order in the module's doc rather than from the code.
    fn expected(race: &Race, v: &Verdict) -> Settled {
        let end = |status, error: Option<&str>, reason, answer: Option<&str>| {
            Settled::End(End { status, error: error.map(str::to_string), reason, answer: answer.map(str::to_string) })
        };
        let failed = |e: &AgentError| end(RunStatus::Failed, Some(&e.to_string()), Some(e.reason()), None);
        if v.suspended {
            return Settled::Suspended;
        }
        match race {
            Race::Lost | Race::Returned(Err(AgentError::Host(HostError::Fenced))) => return Settled::Lost,
            Race::ShutDown if v.resumable && !v.stop_requested => return Settled::HandBack,
            _ => {}
        }
        if v.stop_requested {
            return match race {
                Race::Forced(_) => {
                    end(RunStatus::Cancelled, Some(&AgentError::Interrupted(500).to_string()), None, None)
                }
                Race::Returned(Ok(a)) if v.failure.is_none() => end(RunStatus::Cancelled, None, None, Some(a)),
                _ => end(RunStatus::Cancelled, None, None, None),
            };
        }
        match (race, &v.failure) {
            (Race::Returned(_) | Race::Aborted, Some(f)) => failed(f),
            (Race::Returned(Ok(a)), None) => end(RunStatus::Completed, None, None, Some(a)),
            (Race::Returned(Err(AgentError::Host(HostError::Cancelled))), None) => {
                end(RunStatus::Cancelled, None, None, None)
            }
            (Race::Returned(Err(e)), None) => failed(e),
            (Race::Aborted, None) => failed(&AgentError::failed(FailReason::Host, "the run was aborted")),
            (Race::Forced(ms), _) => {
                end(RunStatus::Cancelled, Some(&AgentError::Interrupted(*ms).to_string()), None, None)
            }
            (Race::ShutDown, _) => {
                failed(&AgentError::failed(FailReason::DrainTimeout, "the host shut down before the run finished"))
            }
            (Race::Wall(ms), _) => {
                failed(&AgentError::failed(FailReason::Limit, format!("wall time of {ms} ms exceeded")))
            }
            (Race::JournalGaveUp, _) => failed(&AgentError::failed(
                FailReason::Host,
                "the run's journal could not be written: the database was unreachable too long",
            )),
            (Race::Lost, _) => unreachable!(),
        }
    }

    #[test]
    fn every_race_and_verdict_settles_as_the_order_says() {
        let mut checked = 0;
        for race in races() {
            for bits in 0..16u8 {
                let v = Verdict {
                    suspended: bits & 1 != 0,
                    failure: (bits & 2 != 0).then(limit),
                    stop_requested: bits & 4 != 0,
                    resumable: bits & 8 != 0,
                };
                assert_eq!(settle(race.clone(), &v), expected(&race, &v), "{race:?} with {v:?}");
                checked += 1;
            }
        }
        assert_eq!(checked, 160);
    }

    #[test]
    fn the_assistant_message_is_the_answer_or_the_partial_text() {
        let done = ended(Ok("all".into()));
        assert_eq!(done.assistant("al".into()), Some(("all".into(), MessageStatus::Complete)));
        let stopped = End { answer: Some("late".into()), ..cancelled(None) };
        assert_eq!(stopped.assistant(String::new()), Some(("late".into(), MessageStatus::Partial)));
        assert_eq!(stopped.assistant("streamed".into()), Some(("streamed".into(), MessageStatus::Partial)));
        let failed = ended(Err(limit()));
        assert_eq!(failed.assistant(String::new()), None);
        assert_eq!(failed.reason, Some(FailReason::Limit));
        assert_eq!(ended(Err(AgentError::Interrupted(9))).status, RunStatus::Cancelled);
    }
}
