"""Unit tests of the pure-Python oracle against bytes computed by hand from
docs/walredo-protocol.md. No daemon is involved: these pin the oracle down so that a mismatch
with the daemon in the other tests points at the daemon (or at a spec ambiguity), not here.
"""

import struct

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key

LSN1 = 0x0000_0001_0000_0020  # xlogid 1, xrecoff 0x20


def u16(page, off):
    return struct.unpack_from("<H", page, off)[0]


def u32(page, off):
    return struct.unpack_from("<I", page, off)[0]


def fresh(special=0, lsn=0x10):
    return o.apply_record(o.ZERO_PAGE, lsn, o.init_page(special))


# ---------------------------------------------------------------------------- encoding


def test_key_packs_as_buffertag_big_endian():
    k = Key(spcnode=0x01020304, dbnode=5, relnode=0x0A0B0C0D, forknum=2, blknum=0xFFFFFFFE)
    assert k.pack() == bytes.fromhex("02" "01020304" "00000005" "0a0b0c0d" "fffffffe")
    assert Key.unpack(k.pack()) == k


def test_record_encoders_produce_documented_bytes():
    assert o.init_page(16) == bytes.fromhex("010010")
    assert o.insert(b"ab", 0) == bytes.fromhex("02" "0000" "6162")
    assert o.insert(b"a", 0x0102) == bytes.fromhex("02" "0102" "61")
    assert o.update(3, b"xyz") == bytes.fromhex("03" "0003" "78797a")
    assert o.delete(0x0203) == bytes.fromhex("04" "0203")
    assert o.prune() == bytes.fromhex("05")
    assert o.set_bits(0x1FFF, b"\x81") == bytes.fromhex("06" "1fff" "81")
    assert o.clear_bits(8, b"\x0f\xf0") == bytes.fromhex("07" "0008" "0ff0")
    assert o.put_bytes(100, b"Z") == bytes.fromhex("08" "0064" "5a")
    assert o.append(b"qq") == bytes.fromhex("09" "7171")


def test_lp_packing_matches_bit_layout():
    # lp_off bits 0-14, lp_flags bits 15-16, lp_len bits 17-31
    assert o.pack_lp(8184, o.LP_NORMAL, 5) == 0x000A9FF8
    assert o.pack_lp(8184, o.LP_DEAD, 5) == 0x000B9FF8
    assert o.pack_lp(0, o.LP_REDIRECT, 0) == 0x00010000


# ---------------------------------------------------------------------------- decoding


@pytest.mark.parametrize(
    "record",
    [
        b"",
        b"\x00",
        b"\x0a",
        b"\x10\x00\x00",  # reserved PostgreSQL family
        b"\x1f",
        b"\xff\x00",
        bytes.fromhex("01"),  # init page: body must be exactly 2
        bytes.fromhex("010000" "00"),
        bytes.fromhex("02" "0000"),  # insert without data
        bytes.fromhex("03" "0001"),  # update without data
        bytes.fromhex("04" "00"),  # delete: exactly 2
        bytes.fromhex("04" "000100"),
        bytes.fromhex("05" "00"),  # prune: empty body
        bytes.fromhex("06" "0000"),  # set bits without mask
        bytes.fromhex("07" "00"),
        bytes.fromhex("08" "0000"),
        bytes.fromhex("09"),  # append without data
    ],
)
def test_decode_rejects_bad_kind_or_length_as_bad_record(record):
    with pytest.raises(o.BadRecord) as exc:
        o.apply_record(fresh(), 0x20, record)
    assert exc.value.code == 2
    assert exc.value.lsn == 0x20


def test_decode_accepts_largest_record():
    r = o.decode_record(b"\x09" + bytes(o.MAX_RECORD_LEN - 1))
    assert r.kind == o.KIND_APPEND and len(r.data) == o.MAX_RECORD_LEN - 1


# ---------------------------------------------------------------------------- init page


def test_init_page_writes_fresh_header_and_lsn():
    page = o.apply_record(bytes([0xAA]) * 8192, LSN1, o.init_page(0))
    expected = bytearray(8192)
    expected[0:24] = bytes.fromhex(
        "01000000"  # pd_lsn xlogid (LE)
        "20000000"  # pd_lsn xrecoff
        "0000"  # checksum
        "0000"  # flags
        "1800"  # pd_lower 24
        "0020"  # pd_upper 8192
        "0020"  # pd_special 8192
        "0420"  # pagesize_version 8192|4 = 0x2004
        "00000000"  # prune_xid
    )
    assert page == bytes(expected)


def test_init_page_with_special_space():
    page = fresh(special=16)
    h = o.read_header(page)
    assert (h.lower, h.upper, h.special) == (24, 8176, 8176)
    page = fresh(special=8168)
    h = o.read_header(page)
    assert (h.lower, h.upper, h.special) == (24, 24, 24)


@pytest.mark.parametrize("special", [4, 12, 8176, 8192, 0xFFF8])
def test_init_page_bad_special_size_fails_apply(special):
    with pytest.raises(o.ApplyFailed):
        o.apply_record(o.ZERO_PAGE, 1, o.init_page(special))


# ---------------------------------------------------------------------------- insert


def test_insert_places_tuple_below_upper_and_adds_pointer():
    page = o.apply_record(fresh(), 0x30, o.insert(b"hello"))
    assert page[12:16] == bytes.fromhex("1c00" "f81f")  # lower 28, upper 8184
    assert page[24:28] == bytes.fromhex("f89f0a00")  # off 8184, NORMAL, len 5
    assert page[8184:8192] == b"hello\x00\x00\x00"
    assert page[0:8] == bytes.fromhex("00000000" "30000000")
    # a second tuple of 9 bytes takes MAXALIGN(9) = 16
    page = o.apply_record(page, 0x40, o.insert(b"123456789"))
    assert u16(page, 12) == 32 and u16(page, 14) == 8168
    assert page[28:32] == struct.pack("<I", 8168 | (1 << 15) | (9 << 17))
    assert page[8168:8184] == b"123456789" + bytes(7)


def test_insert_zero_fills_alignment_padding_over_garbage():
    page = bytearray(fresh())
    page[8000:8192] = b"\xee" * 192  # garbage in the free space
    page = o.apply_record(bytes(page), 0x50, o.insert(b"abc"))
    assert page[8184:8192] == b"abc" + bytes(5)


def test_insert_offnum_zero_reuses_first_unused_slot():
    page = fresh()
    for d in (b"a", b"b", b"c"):
        page = o.apply_record(page, 0x20, o.insert(d))
    # make slot 2 LP_UNUSED by hand (pointer raw 0)
    page = o.apply_record(page, 0x21, o.put_bytes(28, bytes(4)))
    page = o.apply_record(page, 0x22, o.insert(b"d"))
    assert o.get_lp(page, 2) == (8160, o.LP_NORMAL, 1)
    assert u16(page, 12) == 36  # no new slot


def test_insert_explicit_offnum_rules():
    page = o.apply_record(fresh(), 0x20, o.insert(b"a"))  # slot 1
    with pytest.raises(o.ApplyFailed):
        o.apply_record(page, 0x21, o.insert(b"b", 1))  # slot 1 is NORMAL
    with pytest.raises(o.ApplyFailed):
        o.apply_record(page, 0x21, o.insert(b"b", 3))  # maxoff + 2
    page = o.apply_record(page, 0x21, o.insert(b"b", 2))  # maxoff + 1
    assert o.get_lp(page, 2) == (8176, o.LP_NORMAL, 1)


def test_insert_page_full_boundary():
    page = fresh(special=8104)  # pd_upper = 88: free space is exactly 64 bytes
    h = o.read_header(page)
    assert (h.lower, h.upper) == (24, 88)
    for n in (57, 60):  # MAXALIGN 64, + 4 for the new slot > 64
        with pytest.raises(o.ApplyFailed, match="page full"):
            o.apply_record(page, 0x20, o.insert(b"x" * n))
    page = o.apply_record(page, 0x20, o.insert(b"x" * 56))  # 56 + 4 <= 64
    assert (u16(page, 12), u16(page, 14)) == (28, 32)


def test_insert_exactly_filling_page():
    page = fresh(special=8104)  # free 64
    page = o.apply_record(page, 0x20, o.insert(b"x" * 48))  # 48 + 4: free 12
    page = o.apply_record(page, 0x21, o.insert(b"y" * 8))  # 8 + 4 = 12: exactly full
    assert (u16(page, 12), u16(page, 14)) == (32, 32)
    assert o.get_lp(page, 2) == (32, o.LP_NORMAL, 8)
    with pytest.raises(o.ApplyFailed):
        o.apply_record(page, 0x22, o.insert(b"z"))
    with pytest.raises(o.ApplyFailed):
        o.apply_record(page, 0x22, o.append(b"z"))


def test_insert_reusing_slot_needs_no_pointer_space():
    page = fresh(special=8104)  # free 64
    page = o.apply_record(page, 0x20, o.insert(b"x" * 48))  # slot 1 at 40, lower 28
    page = o.apply_record(page, 0x21, o.insert(b"y" * 4))  # slot 2 at 32, lower 32, free 0
    page = o.apply_record(page, 0x22, o.put_bytes(14, struct.pack("<H", 40)))  # upper 40: free 8
    page = o.apply_record(page, 0x23, o.put_bytes(24, bytes(4)))  # slot 1 LP_UNUSED
    page = o.apply_record(page, 0x24, o.insert(b"z" * 8))  # reuses slot 1: needs 8, not 12
    assert o.get_lp(page, 1) == (32, o.LP_NORMAL, 8)
    assert (u16(page, 12), u16(page, 14)) == (32, 32)


# ---------------------------------------------------------------------------- update / delete


def _three_tuples():
    page = fresh()
    page = o.apply_record(page, 0x20, o.insert(b"A" * 10))  # slot 1 at 8176 (16)
    page = o.apply_record(page, 0x21, o.insert(b"B" * 3))  # slot 2 at 8168 (8)
    page = o.apply_record(page, 0x22, o.insert(b"C" * 20))  # slot 3 at 8144 (24)
    return page


def test_three_tuples_layout():
    page = _three_tuples()
    assert [o.get_lp(page, i) for i in (1, 2, 3)] == [
        (8176, 1, 10),
        (8168, 1, 3),
        (8144, 1, 20),
    ]
    assert (u16(page, 12), u16(page, 14)) == (36, 8144)


def test_update_in_place_zero_fills_old_aligned_space():
    page = o.apply_record(_three_tuples(), 0x30, o.update(1, b"xyz"))  # 3 -> 8 <= 16
    assert o.get_lp(page, 1) == (8176, o.LP_NORMAL, 3)
    assert page[8176:8192] == b"xyz" + bytes(13)
    assert u16(page, 14) == 8144  # upper unchanged


def test_update_elsewhere_takes_new_space_and_leaves_garbage():
    page = o.apply_record(_three_tuples(), 0x30, o.update(2, b"0123456789"))  # 10 -> 16 > 8
    assert o.get_lp(page, 2) == (8128, o.LP_NORMAL, 10)
    assert page[8128:8144] == b"0123456789" + bytes(6)
    assert page[8168:8171] == b"BBB"  # old storage stays until prune
    assert u16(page, 14) == 8128 and u16(page, 12) == 36


def test_update_same_aligned_size_is_in_place():
    page = o.apply_record(_three_tuples(), 0x30, o.update(2, b"12345678"))  # 8 -> 8
    assert o.get_lp(page, 2) == (8168, o.LP_NORMAL, 8)
    assert page[8168:8176] == b"12345678"


def test_update_elsewhere_page_full_needs_no_slot_space():
    page = fresh(special=8136)  # pd_upper 56
    page = o.apply_record(page, 0x20, o.insert(b"a"))  # slot 1 at 48, lower 28
    page = o.apply_record(page, 0x21, o.put_bytes(14, struct.pack("<H", 44)))  # free 16
    page2 = o.apply_record(page, 0x22, o.update(1, b"b" * 16))  # exactly 16: fits
    assert o.get_lp(page2, 1) == (28, o.LP_NORMAL, 16)
    assert (u16(page2, 12), u16(page2, 14)) == (28, 28)
    with pytest.raises(o.ApplyFailed, match="page full"):
        o.apply_record(page, 0x22, o.update(1, b"b" * 17))


@pytest.mark.parametrize("rec", [o.update(0, b"x"), o.update(4, b"x"), o.delete(0), o.delete(4)])
def test_update_or_delete_of_missing_slot_fails(rec):
    with pytest.raises(o.ApplyFailed):
        o.apply_record(_three_tuples(), 0x30, rec)


def test_delete_marks_dead_and_keeps_storage():
    page = o.apply_record(_three_tuples(), 0x30, o.delete(2))
    assert page[28:32] == struct.pack("<I", 8168 | (3 << 15) | (3 << 17))
    assert page[8168:8171] == b"BBB"
    with pytest.raises(o.ApplyFailed):
        o.apply_record(page, 0x31, o.delete(2))  # already dead
    with pytest.raises(o.ApplyFailed):
        o.apply_record(page, 0x31, o.update(2, b"x"))


# ---------------------------------------------------------------------------- prune


def test_prune_repacks_tuples_and_truncates_pointers():
    page = _three_tuples()
    page = o.apply_record(page, 0x30, o.update(1, b"0123456789abcdefXYZ"))  # 19 -> 24: elsewhere
    assert o.get_lp(page, 1) == (8120, o.LP_NORMAL, 19)
    page = o.apply_record(page, 0x31, o.delete(3))
    page = o.apply_record(page, 0x32, o.prune())
    # slot 3 (dead, trailing) dropped; by offset descending: slot 2 (8168), slot 1 (8120)
    assert u16(page, 12) == 32
    assert o.get_lp(page, 2) == (8184, o.LP_NORMAL, 3)
    assert o.get_lp(page, 1) == (8160, o.LP_NORMAL, 19)
    assert u16(page, 14) == 8160
    expected_tail = b"0123456789abcdefXYZ" + bytes(5) + b"BBB" + bytes(5)
    assert page[8160:8192] == expected_tail
    assert page[32:8160] == bytes(8160 - 32)  # old garbage zeroed, dropped pointer zeroed
    assert page[36:40] == bytes(4)
    assert page[0:8] == bytes.fromhex("00000000" "32000000")


def test_prune_keeps_redirect_and_zeroes_dead_in_the_middle():
    page = _three_tuples()
    page = o.apply_record(page, 0x30, o.delete(1))
    # slot 2 becomes a redirect by hand: raw pointer 0x00010000 | 3 (points at slot 3)
    page = o.apply_record(page, 0x31, o.put_bytes(28, struct.pack("<I", (2 << 15) | 3)))
    page = o.apply_record(page, 0x32, o.prune())
    assert u16(page, 12) == 36  # slot 3 is NORMAL, nothing trailing to drop
    assert u32(page, 24) == 0
    assert u32(page, 28) == (2 << 15) | 3
    assert o.get_lp(page, 3) == (8168, o.LP_NORMAL, 20)
    assert u16(page, 14) == 8168
    assert page[8168:8192] == b"C" * 20 + bytes(4)


def test_prune_on_empty_page_and_all_dead():
    page = o.apply_record(_three_tuples(), 0x30, o.delete(1))
    page = o.apply_record(page, 0x31, o.delete(2))
    page = o.apply_record(page, 0x32, o.delete(3))
    page = o.apply_record(page, 0x33, o.prune())
    assert (u16(page, 12), u16(page, 14), u16(page, 16)) == (24, 8192, 8192)
    assert page[8:] == fresh()[8:]


def test_prune_discards_appended_data_and_padding_garbage():
    page = o.apply_record(fresh(special=8), 0x20, o.insert(b"k"))  # at 8176
    page = o.apply_record(page, 0x21, o.append(b"ZZZZZZZZZ"))  # 16 bytes at 8160
    assert u16(page, 14) == 8160 and page[8160:8176] == b"Z" * 9 + bytes(7)
    page = o.apply_record(page, 0x22, o.put_bytes(8177, b"\x66"))  # padding of tuple 1
    page = o.apply_record(page, 0x23, o.put_bytes(8186, b"\x55"))  # special space
    page = o.apply_record(page, 0x24, o.prune())
    assert u16(page, 14) == 8176
    assert page[8160:8176] == bytes(16)
    assert page[8176:8184] == b"k" + bytes(7)  # padding re-zeroed
    assert page[8184:8192] == bytes.fromhex("0000550000000000")  # special space kept


def test_prune_equal_offsets_lower_slot_first():
    page = o.apply_record(fresh(), 0x20, o.insert(b"abcd"))  # slot 1 at 8184
    page = o.apply_record(page, 0x21, o.insert(b"efgh"))  # slot 2 at 8176
    # point slot 2 at slot 1's storage with length 2 (overlapping tuples, corrupt but accepted)
    page = o.apply_record(page, 0x22, o.put_bytes(28, struct.pack("<I", o.pack_lp(8184, 1, 2))))
    page = o.apply_record(page, 0x23, o.prune())
    assert o.get_lp(page, 1) == (8184, o.LP_NORMAL, 4)
    assert o.get_lp(page, 2) == (8176, o.LP_NORMAL, 2)
    assert page[8176:8192] == b"ab" + bytes(6) + b"abcd" + bytes(4)


def test_prune_corrupt_tuple_lengths_fails():
    page = fresh(special=8192 - 24 - 8 - 16)  # 2 slots + 16 bytes of tuples at most
    page = o.apply_record(page, 0x20, o.insert(b"a" * 8))
    page = o.apply_record(page, 0x21, o.insert(b"b" * 8))
    # make both tuples claim 16 bytes at the same offset: 32 > special - lower = 16
    lp = o.pack_lp(u16(page, 14), o.LP_NORMAL, 16)
    page = o.apply_record(page, 0x22, o.put_bytes(24, struct.pack("<II", lp, lp)))
    with pytest.raises(o.ApplyFailed, match="tuple lengths"):
        o.apply_record(page, 0x23, o.prune())


# ---------------------------------------------------------------------------- header / pointer checks


@pytest.mark.parametrize(
    "field_off,value",
    [
        (12, 23),  # pd_lower below 24
        (12, 26),  # pd_lower not 24 + 4k
        (12, 8200),  # pd_lower above pd_upper
        (14, 8193),  # pd_upper above pd_special
        (16, 8188),  # pd_special not a multiple of 8
        (16, 8200),  # pd_special above the page
    ],
)
@pytest.mark.parametrize("rec", [o.insert(b"x"), o.update(1, b"x"), o.delete(1), o.prune(), o.append(b"x")])
def test_tuple_records_fail_on_corrupt_header(field_off, value, rec):
    page = o.apply_record(fresh(), 0x20, o.insert(b"y"))
    page = o.apply_record(page, 0x21, o.put_bytes(field_off, struct.pack("<H", value)))
    with pytest.raises(o.ApplyFailed, match="corrupt page header"):
        o.apply_record(page, 0x22, rec)


def test_unaligned_upper_and_odd_pagesize_version_are_accepted():
    page = o.apply_record(fresh(), 0x20, o.put_bytes(14, struct.pack("<H", 8191)))  # upper 8191
    page = o.apply_record(page, 0x21, o.put_bytes(18, b"\x00\x00"))
    page = o.apply_record(page, 0x22, o.insert(b"z"))
    assert o.get_lp(page, 1) == (8183, o.LP_NORMAL, 1)
    assert page[8183:8191] == b"z" + bytes(7)


@pytest.mark.parametrize("rec", [o.update(1, b"x"), o.delete(1), o.prune()])
@pytest.mark.parametrize(
    "lp",
    [
        o.pack_lp(8100, o.LP_NORMAL, 4),  # below pd_upper (8184)
        o.pack_lp(8184, o.LP_NORMAL, 9),  # MAXALIGN(9)=16 runs past pd_special
        o.pack_lp(8184, o.LP_NORMAL, 0),  # empty tuple
    ],
)
def test_corrupt_line_pointer_fails(rec, lp):
    page = o.apply_record(fresh(), 0x20, o.insert(b"y"))
    page = o.apply_record(page, 0x21, o.put_bytes(24, struct.pack("<I", lp)))
    with pytest.raises(o.ApplyFailed, match="corrupt line pointer"):
        o.apply_record(page, 0x22, rec)


def test_pointers_of_other_kinds_are_not_checked():
    page = o.apply_record(fresh(), 0x20, o.insert(b"y"))
    page = o.apply_record(page, 0x21, o.insert(b"w"))
    page = o.apply_record(page, 0x22, o.put_bytes(24, struct.pack("<I", o.pack_lp(5, o.LP_DEAD, 9))))
    page = o.apply_record(page, 0x23, o.delete(2))
    page = o.apply_record(page, 0x24, o.prune())
    assert u16(page, 12) == 24


# ---------------------------------------------------------------------------- raw byte records


def test_set_clear_put_bytes():
    page = fresh()
    page = o.apply_record(page, 0x20, o.set_bits(100, b"\x0f\xf0"))
    assert page[100:102] == b"\x0f\xf0"
    page = o.apply_record(page, 0x21, o.set_bits(100, b"\x30"))
    assert page[100] == 0x3F
    page = o.apply_record(page, 0x22, o.clear_bits(100, b"\x11\xff"))
    assert page[100:102] == b"\x2e\x00"
    page = o.apply_record(page, 0x23, o.put_bytes(8190, b"\xab\xcd"))
    assert page[8190:8192] == b"\xab\xcd"


@pytest.mark.parametrize("maker", [o.set_bits, o.clear_bits, o.put_bytes])
def test_byte_range_boundary(maker):
    o.apply_record(fresh(), 0x20, maker(8191, b"\x01"))
    with pytest.raises(o.ApplyFailed):
        o.apply_record(fresh(), 0x20, maker(8191, b"\x01\x01"))
    with pytest.raises(o.ApplyFailed):
        o.apply_record(fresh(), 0x20, maker(0xFFFF, b"\x01"))


def test_lsn_is_written_last_over_put_bytes():
    page = o.apply_record(fresh(), 0x0000_0002_0000_0003, o.put_bytes(0, b"\xff" * 12))
    assert page[0:12] == bytes.fromhex("02000000" "03000000" "ffffffff")


def test_raw_byte_records_need_no_valid_header():
    page = o.apply_record(o.ZERO_PAGE, 0x20, o.set_bits(4000, b"\x01"))
    assert page[4000] == 1 and page[4:8] == b"\x20\x00\x00\x00"


def test_append_lowers_upper_without_pointer():
    page = o.apply_record(fresh(), 0x20, o.append(b"abcdefghi"))
    assert (u16(page, 12), u16(page, 14)) == (24, 8176)
    assert page[8176:8192] == b"abcdefghi" + bytes(7)
    with pytest.raises(o.ApplyFailed):
        o.apply_record(fresh(special=8168), 0x20, o.append(b"a"))


def test_failed_record_leaves_page_unchanged():
    page = _three_tuples()
    before = bytes(page)
    with pytest.raises(o.ApplyFailed):
        o.apply_record(page, 0x99, o.delete(9))
    assert page == before


# ---------------------------------------------------------------------------- redo / record set


def test_redo_reports_first_failing_record_lsn():
    with pytest.raises(o.ApplyFailed) as exc:
        o.redo(None, [(10, o.init_page()), (11, o.delete(1)), (12, b"\x7f")])
    assert exc.value.lsn == 11
    with pytest.raises(o.BadRecord) as exc:
        o.redo(None, [(10, o.init_page()), (12, b"\x7f"), (13, o.delete(1))])
    assert exc.value.lsn == 12


def test_redo_without_base_starts_from_zero_page():
    assert o.redo(None, [(5, o.set_bits(10, b"\x01"))])[10] == 1
    # a record needing a header on an all-zero page fails (pd_lower 0 < 24)
    with pytest.raises(o.ApplyFailed):
        o.redo(None, [(5, o.insert(b"x"))])


def test_record_set_uses_newest_image_and_records_up_to_lsn():
    k = Key.rel_block(1000, 7)
    other = Key.rel_block(1000, 8)
    rs = o.RecordSet()
    rs.add(k, 10, o.RECORD, o.init_page())
    rs.add(k, 20, o.RECORD, o.insert(b"first"))
    image = bytes([7]) * 8192
    rs.add(other, 25, o.IMAGE, image)
    img = fresh(lsn=30)
    rs.add(k, 30, o.IMAGE, img)
    rs.add(k, 40, o.RECORD, o.insert(b"second"))
    with pytest.raises(o.NotFound):
        rs.get_page(k, 9)
    with pytest.raises(o.NotFound):
        rs.get_page(Key.rel_block(1000, 9), 100)
    p20 = rs.get_page(k, 25)
    assert o.tuple_data(p20, 1) == b"first" and p20[4:8] == struct.pack("<I", 20)
    assert rs.get_page(k, 30) == img
    assert rs.get_page(k, 39) == img
    p40 = rs.get_page(k, 2**64 - 1)
    assert o.maxoff(p40) == 1 and o.tuple_data(p40, 1) == b"second"
    assert rs.get_page(other, 1000) == image


def test_record_set_refuses_histories_the_daemon_must_refuse():
    k = Key.rel_block(1, 1)
    rs = o.RecordSet()
    rs.add(k, 10, o.RECORD, o.init_page())
    with pytest.raises(ValueError):
        rs.add(k, 9, o.RECORD, o.init_page())
    with pytest.raises(ValueError):
        rs.add(k, 10, o.RECORD, o.init_page())
    with pytest.raises(ValueError):
        rs.add(k, 11, o.IMAGE, bytes(8191))
    with pytest.raises(ValueError):
        rs.add(k, 11, o.RECORD, b"")
