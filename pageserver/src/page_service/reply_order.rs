//! Which replies of a connection go out in the next write: a pure policy, no sockets, no tasks.
//!
//! The replies queue in request order. The oldest goes first, whenever it is done (the writer
//! waits for it); with it go the replies right behind it that are done already, up to a bound
//! per write, and none after one that closes the connection. So replies leave in request
//! order, a write never waits for a reply behind one that is ready, and a slow request holds up
//! only the replies queued behind it on its own connection.
//!
//! Invariant: [`ReplyOrder::next_batch`] returns a prefix of the queue (order kept), of at
//! least one entry when the front is done, at most `max` entries, and ends at the first
//! closing reply.

use std::collections::VecDeque;

/// What the policy needs to know of a queued reply.
pub(super) trait Queued {
    /// Its bytes are known (the request finished).
    fn is_done(&self) -> bool;
    /// The connection closes once it is written (known only when done).
    fn closes(&self) -> bool;
}

/// A connection's replies not yet written, in request order, numbered from 0 in the order
/// pushed (the number finds a reply whose request finishes out of order).
pub(super) struct ReplyOrder<T> {
    queue: VecDeque<T>,
    /// The number of the front entry.
    front: u64,
}

impl<T: Queued> ReplyOrder<T> {
    pub(super) fn new() -> ReplyOrder<T> {
        ReplyOrder { queue: VecDeque::new(), front: 0 }
    }

    /// Queues `reply` and returns its number.
    pub(super) fn push(&mut self, reply: T) -> u64 {
        self.queue.push_back(reply);
        self.front + self.queue.len() as u64 - 1
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The oldest reply, which the next write must start with (the writer waits until it is
    /// done).
    pub(super) fn front(&self) -> Option<&T> {
        self.queue.front()
    }

    /// The reply numbered `number`, if it is still queued.
    pub(super) fn get_mut(&mut self, number: u64) -> Option<&mut T> {
        let at = usize::try_from(number.checked_sub(self.front)?).ok()?;
        self.queue.get_mut(at)
    }

    /// Takes the next write's replies: the front if it is done, then those done behind it, at
    /// most `max`, ending at a closing one. Empty if the front is not done.
    pub(super) fn next_batch(&mut self, max: usize) -> std::collections::vec_deque::Drain<'_, T> {
        let mut take = 0;
        for reply in self.queue.iter().take(max) {
            if !reply.is_done() {
                break;
            }
            take += 1;
            if reply.closes() {
                break;
            }
        }
        self.front += take as u64;
        self.queue.drain(..take)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply: its id, whether it is done, whether it closes.
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct R(u32, bool, bool);

    impl Queued for R {
        fn is_done(&self) -> bool {
            self.1
        }
        fn closes(&self) -> bool {
            self.2
        }
    }

    fn order(replies: &[R]) -> ReplyOrder<R> {
        let mut order = ReplyOrder::new();
        for &r in replies {
            order.push(r);
        }
        order
    }

    fn ids(batch: impl Iterator<Item = R>) -> Vec<u32> {
        batch.map(|r| r.0).collect()
    }

    #[test]
    fn a_batch_is_the_done_prefix_in_request_order() {
        let mut o = order(&[R(1, true, false), R(2, true, false), R(3, false, false), R(4, true, false)]);
        assert_eq!(ids(o.next_batch(64)), vec![1, 2]);
        // Reply 4 is done but waits behind 3: order before readiness.
        assert!(o.next_batch(64).next().is_none());
        o.get_mut(2).unwrap().1 = true;
        assert_eq!(ids(o.next_batch(64)), vec![3, 4]);
        assert!(o.is_empty());
    }

    #[test]
    fn a_number_finds_its_reply_until_it_is_taken() {
        let mut o: ReplyOrder<R> = ReplyOrder::new();
        assert_eq!(o.push(R(10, true, false)), 0);
        assert_eq!(o.push(R(11, false, false)), 1);
        assert_eq!(ids(o.next_batch(64)), vec![10]);
        assert!(o.get_mut(0).is_none(), "taken");
        assert_eq!(o.push(R(12, false, false)), 2);
        o.get_mut(2).unwrap().1 = true;
        assert!(o.next_batch(64).next().is_none(), "12 waits behind 11");
        o.get_mut(1).unwrap().1 = true;
        assert_eq!(ids(o.next_batch(64)), vec![11, 12]);
        assert!(o.get_mut(3).is_none(), "not pushed yet");
    }

    #[test]
    fn a_batch_holds_at_most_max_replies() {
        let mut o = order(&(0..10).map(|i| R(i, true, false)).collect::<Vec<_>>());
        assert_eq!(ids(o.next_batch(4)), vec![0, 1, 2, 3]);
        assert_eq!(ids(o.next_batch(4)), vec![4, 5, 6, 7]);
        assert_eq!(ids(o.next_batch(4)), vec![8, 9]);
        assert!(o.next_batch(4).next().is_none());
    }

    #[test]
    fn nothing_goes_after_a_closing_reply_in_its_batch() {
        let mut o = order(&[R(1, true, false), R(2, true, true), R(3, true, false)]);
        assert_eq!(ids(o.next_batch(64)), vec![1, 2]);
        assert_eq!(ids(o.next_batch(64)), vec![3]);
    }

    #[test]
    fn an_empty_queue_or_a_pending_front_gives_no_batch() {
        let mut o: ReplyOrder<R> = ReplyOrder::new();
        assert!(o.next_batch(64).next().is_none());
        assert!(o.front().is_none());
        o.push(R(1, false, false));
        o.push(R(2, true, false));
        assert!(o.next_batch(64).next().is_none());
        assert!(!o.is_empty());
    }
}
