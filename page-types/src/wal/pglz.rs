//! PGLZ decompression (PostgreSQL's `pglz_decompress` in `src/common/pg_lzcompress.c`), for
//! full-page images written with `wal_compression = pglz`.
//!
//! The format: a control byte whose bits, lowest first, say what each of the next up to eight
//! items is: a literal byte (bit 0) or a back-reference (bit 1) of two or three bytes. A
//! back-reference's first byte holds `length - 3` in its low nibble and the offset's high 4 bits
//! in its high nibble, the second byte the offset's low 8 bits; a length nibble of 15 means a
//! third byte follows and is added (lengths 3 to 273, offsets 1 to 4095). The copy may overlap
//! its own output (an offset shorter than the length repeats a pattern).
//!
//! **Invariants:** the output is never longer than the size asked for; decompression succeeds
//! only if the input is used exactly and the output is exactly that size (PostgreSQL's
//! `check_complete`); malformed input (a zero offset, an offset reaching before the output, a
//! truncated back-reference, bytes left over) is an error, never a panic.

/// Why a PGLZ stream is not a valid compressed form of the size asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PglzError {
    /// A back-reference is cut off by the end of the input.
    #[error("pglz back-reference truncated at input byte {at}")]
    Truncated { at: usize },
    /// A back-reference has offset 0 or points before the start of the output.
    #[error("pglz back-reference at input byte {at} has offset {offset} with {produced} bytes produced")]
    BadOffset { at: usize, offset: usize, produced: usize },
    /// The stream ended before producing the expected size.
    #[error("pglz output is {produced} bytes, expected {expected}")]
    ShortOutput { produced: usize, expected: usize },
    /// The expected size was produced before the input was used up.
    #[error("pglz input has {left} bytes left after the expected {expected} bytes of output")]
    TrailingInput { left: usize, expected: usize },
}

/// Decompresses `src`, which must decompress to exactly `raw_size` bytes.
pub fn pglz_decompress(src: &[u8], raw_size: usize) -> Result<Vec<u8>, PglzError> {
    // The output never exceeds raw_size; reserve no more than the input could expand to
    // (273 bytes per two input bytes at most), so a huge raw_size alone allocates nothing big.
    let mut out: Vec<u8> = Vec::with_capacity(raw_size.min(src.len().saturating_mul(137).saturating_add(8)));
    let mut sp = 0usize;
    while sp < src.len() && out.len() < raw_size {
        let ctrl = src[sp];
        sp += 1;
        let mut bits = ctrl;
        for _ in 0..8 {
            if sp >= src.len() || out.len() >= raw_size {
                break;
            }
            if bits & 1 != 0 {
                let at = sp;
                let (b0, b1) = match (src.get(sp), src.get(sp + 1)) {
                    (Some(&b0), Some(&b1)) => (b0, b1),
                    _ => return Err(PglzError::Truncated { at }),
                };
                sp += 2;
                let mut len = usize::from(b0 & 0x0f) + 3;
                let offset = (usize::from(b0 & 0xf0) << 4) | usize::from(b1);
                if len == 18 {
                    let Some(&extra) = src.get(sp) else {
                        return Err(PglzError::Truncated { at });
                    };
                    sp += 1;
                    len += usize::from(extra);
                }
                let produced = out.len();
                if offset == 0 || offset > produced {
                    return Err(PglzError::BadOffset { at, offset, produced });
                }
                len = len.min(raw_size - produced);
                // Byte by byte: an offset shorter than the length repeats what this copy wrote.
                let from = produced - offset;
                for i in 0..len {
                    let Some(&b) = out.get(from + i) else {
                        return Err(PglzError::BadOffset { at, offset, produced });
                    };
                    out.push(b);
                }
            } else {
                out.push(src[sp]);
                sp += 1;
            }
            bits >>= 1;
        }
    }
    if out.len() != raw_size {
        return Err(PglzError::ShortOutput { produced: out.len(), expected: raw_size });
    }
    if sp != src.len() {
        return Err(PglzError::TrailingInput { left: src.len() - sp, expected: raw_size });
    }
    Ok(out)
}

/// A simple, valid PGLZ compressor for tests: literals, and runs of a repeated byte as
/// back-references at offset 1. Enough to build compressed page images to decode.
#[cfg(test)]
pub(crate) fn pglz_compress_runs(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < data.len() {
        let ctrl_at = out.len();
        out.push(0u8);
        let mut ctrl = 0u8;
        for bit in 0..8 {
            if i >= data.len() {
                break;
            }
            let run =
                if i > 0 { data[i..].iter().take(273).take_while(|&&b| b == data[i - 1]).count() } else { 0 };
            if run >= 3 {
                ctrl |= 1 << bit;
                if run >= 18 {
                    out.push(0x0f);
                    out.push(1);
                    out.push((run - 18) as u8);
                } else {
                    out.push((run - 3) as u8);
                    out.push(1);
                }
                i += run;
            } else {
                out.push(data[i]);
                i += 1;
            }
        }
        out[ctrl_at] = ctrl;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pglz_decompresses_a_hand_computed_stream() {
        // Control 0b0000_1000: three literals, then a back-reference: length nibble 3 (6 bytes),
        // offset 3 -> "abc" + "abcabc", the copy overlapping its own output.
        let src = [0x08, b'a', b'b', b'c', 0x03, 0x03];
        assert_eq!(pglz_decompress(&src, 9).as_deref(), Ok(&b"abcabcabc"[..]));
        // Control 0b10: a literal, then nibble 15 with an extra byte 2: length 18 + 2 = 20,
        // offset 1 -> 21 bytes of 'x'.
        let src = [0x02, b'x', 0x0f, 0x01, 0x02];
        assert_eq!(pglz_decompress(&src, 21), Ok(vec![b'x'; 21]));
        // An offset over 255 uses the high nibble: 300 literals (37 control bytes of 0 with 8
        // literals each, then one with 4), and as the fifth item of that last group (control
        // bit 4: 0x10) a back-reference of 3 bytes at offset 300 = 0x12C: bytes 0x10 (offset
        // high nibble 1, length nibble 0) and 0x2C.
        let mut raw: Vec<u8> = (0..300u32).map(|i| (i % 251) as u8).collect();
        let mut src = Vec::new();
        for chunk in raw.chunks(8) {
            src.push(if chunk.len() == 4 { 0x10 } else { 0x00 });
            src.extend_from_slice(chunk);
        }
        src.extend_from_slice(&[0x10, 0x2C]);
        raw.extend_from_slice(&[0, 1, 2]);
        assert_eq!(pglz_decompress(&src, raw.len()), Ok(raw));
    }

    #[test]
    fn pglz_rejects_malformed_streams() {
        // Offset 0.
        assert!(matches!(
            pglz_decompress(&[0x02, b'a', 0x00, 0x00], 4),
            Err(PglzError::BadOffset { offset: 0, .. })
        ));
        // Offset before the start of the output.
        assert!(matches!(
            pglz_decompress(&[0x02, b'a', 0x00, 0x02], 4),
            Err(PglzError::BadOffset { offset: 2, .. })
        ));
        // A back-reference as the very first item.
        assert!(matches!(pglz_decompress(&[0x01, 0x00, 0x01], 3), Err(PglzError::BadOffset { .. })));
        // Truncated back-reference: one byte of two, and a missing length byte.
        assert!(matches!(pglz_decompress(&[0x02, b'a', 0x00], 4), Err(PglzError::Truncated { .. })));
        assert!(matches!(pglz_decompress(&[0x02, b'a', 0x0f, 0x01], 30), Err(PglzError::Truncated { .. })));
        // Too little output, and input left over once the output is complete.
        assert!(matches!(
            pglz_decompress(&[0x00, b'a', b'b'], 3),
            Err(PglzError::ShortOutput { produced: 2, .. })
        ));
        assert!(matches!(
            pglz_decompress(&[0x00, b'a', b'b', b'c'], 2),
            Err(PglzError::TrailingInput { left: 1, .. })
        ));
        assert!(matches!(pglz_decompress(&[], 1), Err(PglzError::ShortOutput { .. })));
        assert_eq!(pglz_decompress(&[], 0), Ok(Vec::new()));
    }

    #[test]
    fn pglz_output_is_bounded_by_the_size_asked_for() {
        // A back-reference longer than what is left is cut to fit (as PostgreSQL does), and
        // then the leftover input is an error rather than more output.
        let src = [0x02, b'a', 0x0f, 0x01, 0xff];
        assert_eq!(pglz_decompress(&src, 10), Ok(vec![b'a'; 10]));
        assert!(pglz_decompress(&[0x02, b'a', 0x0f, 0x01, 0xff, 0x00, b'z'], 10).is_err());
    }

    proptest! {
        #[test]
        fn pglz_never_panics_on_any_input(src in proptest::collection::vec(any::<u8>(), 0..600), raw in 0usize..9000) {
            if let Ok(out) = pglz_decompress(&src, raw) {
                prop_assert_eq!(out.len(), raw);
            }
        }

        #[test]
        fn pglz_round_trips_the_test_compressor(runs in proptest::collection::vec((any::<u8>(), 1usize..400), 0..40)) {
            let data: Vec<u8> = runs.iter().flat_map(|&(b, n)| std::iter::repeat_n(b, n)).collect();
            let packed = pglz_compress_runs(&data);
            prop_assert_eq!(pglz_decompress(&packed, data.len()), Ok(data));
        }
    }
}
