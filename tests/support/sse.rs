//! A small SSE client over reqwest, on the crate's one decoder
//! (`agent_host::stream::decode`): fields id, event, data; comments; a blank
//! line dispatches; a character split across reads is put back together.

use std::collections::VecDeque;
use std::time::Duration;

use agent_host::stream::decode::SseDecoder;
use futures::StreamExt;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub id: Option<String>,
    pub event: String,
    pub data: Value,
}

pub struct SseClient {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    decoder: SseDecoder,
    frames: VecDeque<Frame>,
    /// Comment lines (keepalives) seen so far.
    pub comments: usize,
}

impl SseClient {
    /// Opens `url` with `Accept: text/event-stream` and optional `Last-Event-ID`.
    pub async fn connect(url: &str, token: &str, last_event_id: Option<i32>) -> SseClient {
        let mut req = reqwest::Client::new().get(url).bearer_auth(token).header("Accept", "text/event-stream");
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id.to_string());
        }
        let res = req.send().await.unwrap();
        assert_eq!(res.status(), 200);
        let ct = res.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        SseClient {
            stream: res.bytes_stream().boxed(),
            decoder: SseDecoder::default(),
            frames: VecDeque::new(),
            comments: 0,
        }
    }

    /// The next frame, or `None` when the server closed the stream.
    pub async fn next(&mut self, within: Duration) -> Option<Frame> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(f) = self.frames.pop_front() {
                return Some(f);
            }
            let chunk = tokio::time::timeout_at(deadline, self.stream.next()).await.expect("SSE frame timed out");
            let (mut out, ended) = (Vec::new(), chunk.is_none());
            match chunk {
                Some(chunk) => self.decoder.feed_frames(&chunk.unwrap(), &mut out).expect("an SSE body"),
                None => out.extend(self.decoder.finish_frame().expect("an SSE body")),
            }
            self.comments = self.decoder.comments() as usize;
            self.frames.extend(out.into_iter().map(|f| Frame {
                id: f.id,
                event: f.event.unwrap_or_else(|| "message".into()),
                data: serde_json::from_str(&f.data).expect("frame data is JSON"),
            }));
            if ended {
                return self.frames.pop_front();
            }
        }
    }

    /// Frames until the stream ends (after `complete`).
    pub async fn collect(&mut self, within: Duration) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(f) = self.next(within).await {
            frames.push(f);
        }
        frames
    }
}
