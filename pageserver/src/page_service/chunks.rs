//! A batch of replies as the writers send it: a list of shared `Bytes` chunks, and how a send
//! that took part of them moves on. Shared by both writers (`writer`'s `writev` and the io_uring
//! writer), below both, so that neither imports the other for it.

use bytes::{Buf, Bytes};

/// Counts `sent` bytes off `chunks[*start..]`: the chunks sent whole are passed (`*start`
/// moves past them, and past empty ones), the first one sent in part loses its front. Whether
/// every chunk is sent. Shared by both writers.
pub(super) fn consume(chunks: &mut [Bytes], start: &mut usize, mut sent: usize) -> bool {
    while let Some(chunk) = chunks.get_mut(*start) {
        let n = sent.min(chunk.len());
        chunk.advance(n);
        sent -= n;
        if !chunk.is_empty() {
            break;
        }
        *start += 1;
    }
    *start == chunks.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consume_passes_whole_chunks_and_trims_the_one_sent_in_part() {
        let mut chunks: Vec<Bytes> = vec![
            Bytes::from_static(b"abc"),
            Bytes::new(),
            Bytes::from_static(b"defg"),
            Bytes::from_static(b"h"),
        ];
        let mut start = 0;
        assert!(!consume(&mut chunks, &mut start, 5));
        // "abc" and the empty chunk are passed; "defg" lost "de".
        assert_eq!((start, &chunks[start][..]), (2, &b"fg"[..]));
        assert!(!consume(&mut chunks, &mut start, 0));
        assert_eq!(start, 2);
        assert!(consume(&mut chunks, &mut start, 3));
        assert_eq!(start, 4);
    }
}
