//! Guest stdout and stderr: kept up to a cap for the host's log, the rest
//! counted and dropped. Writing never fails, so a chatty guest is not killed
//! for printing.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};

#[derive(Clone)]
pub struct CappedOutput {
    inner: Arc<Mutex<(Vec<u8>, usize)>>,
    cap: usize,
}

impl CappedOutput {
    pub fn new(cap: usize) -> Self {
        CappedOutput { inner: Arc::new(Mutex::new((Vec::new(), 0))), cap }
    }

    /// What was kept, and how many bytes were dropped past the cap.
    pub fn contents(&self) -> (Vec<u8>, usize) {
        self.inner.lock().unwrap().clone()
    }
}

impl IsTerminal for CappedOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CappedOutput {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl AsyncWrite for CappedOutput {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let mut inner = self.inner.lock().unwrap();
        let room = self.cap.saturating_sub(inner.0.len());
        let kept = buf.len().min(room);
        inner.0.extend_from_slice(&buf[..kept]);
        inner.1 += buf.len() - kept;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
