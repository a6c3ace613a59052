//! The steps of a round trip that are the same for every process kind: the request joins the
//! child's write queue and waits until it is written, or until it holds the stdin lock with
//! its request still queued, and then writes the queue ([`crate::walredo::write_queue`]); then
//! it waits for its reply, and reads the child's stdout for everyone while it holds that lock
//! ([`pipeline::Waiter`]). How a kind writes a batch and reads replies, and how it waits for
//! its pipes meanwhile, is its [`KindPipes`].

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use crate::walredo::pipeline::{self, ChildReply, Claim, Patience, ProcessError, Shared, Turn, Waiter};
use crate::walredo::priority::WriteTicket;
use crate::walredo::request::Request;
use crate::walredo::write_queue::{WriteQueue, WriteTurn};

/// A child's two pipes, its write queue, and the state the users of both share; every kind
/// has one.
pub(super) struct ChildPipes<I, O> {
    /// tokio mutexes: waiting for a pipe blocks no thread, and the guards are held across
    /// awaits.
    pub(super) stdin: tokio::sync::Mutex<pipeline::PipeWriter<I>>,
    /// Requests waiting to be written, by whichever of them holds `stdin`.
    pub(super) queue: WriteQueue,
    pub(super) stdout: tokio::sync::Mutex<pipeline::PipeReader<O>>,
    pub(super) shared: Shared,
}

impl<I, O> ChildPipes<I, O> {
    pub(super) fn new(stdin: I, stdout: O) -> ChildPipes<I, O> {
        ChildPipes {
            stdin: tokio::sync::Mutex::new(pipeline::PipeWriter::new(stdin)),
            queue: WriteQueue::default(),
            stdout: tokio::sync::Mutex::new(pipeline::PipeReader::new(stdout)),
            shared: Shared::new(),
        }
    }
}

/// A kind's pipes, as the round trip uses them.
pub(super) trait KindPipes: Sync {
    /// The child's stdin and stdout ends.
    type In: Send;
    type Out: Send;
    /// How one round trip waits for the pipes; chosen once, at its start.
    type Mode: Copy + Send + Sync;

    fn mode(&self) -> Self::Mode;
    fn pipes(&self) -> &ChildPipes<Self::In, Self::Out>;

    /// As the holder of the stdin lock: takes the queue as a batch
    /// ([`crate::walredo::write_queue::Batch::take`], which fences the writer if the batch
    /// ends halfway through a request) and writes it to its end or its failure.
    /// `on_broken_write` goes to the batch. An error fails this round trip before anything
    /// was taken.
    fn write_queued<F: FnOnce() + Send>(
        &self,
        writer: &mut pipeline::PipeWriter<Self::In>,
        on_broken_write: Option<F>,
        mode: Self::Mode,
        patience: Patience,
    ) -> impl Future<Output = Result<(), ProcessError>> + Send;

    /// As the holder of the stdout lock: reads replies, parking the others', until
    /// `waiter`'s comes or its wait fails.
    fn read_own(
        &self,
        stdout: &mut pipeline::PipeReader<Self::Out>,
        waiter: &Waiter<'_>,
        mode: Self::Mode,
    ) -> impl Future<Output = Result<ChildReply, ProcessError>> + Send;
}

/// One request out, its reply back (see [`super::Process::round_trip`]); `on_broken_write`
/// runs if the future is dropped halfway through writing a batch (the stream is broken: the
/// caller retires the child).
pub(super) async fn round_trip<K: KindPipes>(
    kind: &K,
    request: &Arc<Request>,
    ticket: WriteTicket<'_>,
    patience: Patience,
    on_broken_write: impl FnOnce() + Send,
) -> Result<ChildReply, ProcessError> {
    let mode = kind.mode();
    let ChildPipes { stdin, queue, stdout, shared } = kind.pipes();
    let queue_deadline = Instant::now() + patience.timeout;
    let mut on_broken_write = Some(on_broken_write);
    let mut queued = queue.push(shared, request);
    let seq = loop {
        match queued.turn(stdin, queue_deadline, patience).await? {
            WriteTurn::Written(seq) => break seq,
            // Everything queued, this request among it.
            WriteTurn::Writer(mut writer) => {
                kind.write_queued(&mut writer, on_broken_write.take(), mode, patience).await?;
            }
        }
    };
    // The request is written: its place in the foreground writer queue goes.
    drop(ticket);
    let waiter = Waiter { shared, seq, queue_deadline, patience };
    // Dropped with the future while the reply is awaited, the claim abandons the slot.
    let read = async {
        let mut stdout = match waiter.turn(stdout).await? {
            Turn::Reply(reply) => return Ok(reply),
            Turn::Reader(stdout) => stdout,
        };
        let result = kind.read_own(&mut stdout, &waiter, mode).await;
        shared.park_read(&mut stdout.replies);
        result
    };
    Claim::new(&shared.replies, seq).settle(read.await)
}
