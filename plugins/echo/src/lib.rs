//! Streams the user's message back word by word, `config.delay_ms` apart
//! (default 0), checking cancel between words. The demo and test workhorse.

use agent_plugin::{export_agent, Agent, HostError, Refusal, Turn};

struct Echo;

impl Agent for Echo {
    fn run(turn: Turn) -> Result<String, String> {
        let delay = std::time::Duration::from_millis(turn.config_u64("delay_ms", 0));
        let mut said = String::new();
        for word in turn.content.split_inclusive(' ') {
            if turn.cancelled() {
                return Err(Refusal(HostError::Cancelled).into());
            }
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            turn.delta(word)?;
            said.push_str(word);
        }
        Ok(said)
    }
}

export_agent!(Echo);
