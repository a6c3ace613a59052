"""Page-format edge cases of docs/walredo-protocol.md, through the whole daemon: corrupt headers
and line pointers, redirects, stale unused pointers, overlapping tuples, exact fits, unaligned
pd_upper, byte ranges at the page end, LSNs above 2^32. Each scenario is one key's history; the
daemon's answer at every LSN (page or redo_failed) must equal the oracle's."""

import struct

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import LATEST
from fixtures.workload import verify

R, I = o.RECORD, o.IMAGE


def _lp(off, flags, length):
    return struct.pack("<I", o.pack_lp(off, flags, length))


def _three():
    return [o.init_page(0), o.insert(b"A" * 10), o.insert(b"B" * 3), o.insert(b"C" * 20)]


SCENARIOS = {
    "prune_keeps_redirect": _three() + [o.delete(1), o.put_bytes(28, struct.pack("<I", (2 << 15) | 3)), o.prune()],
    "prune_zeroes_stale_unused": _three() + [o.put_bytes(24, _lp(8176, o.LP_UNUSED, 10)),
                                             o.put_bytes(32, _lp(8144, o.LP_UNUSED, 20)), o.prune()],
    "prune_overlapping_tuples": [o.init_page(0), o.insert(b"abcd"), o.insert(b"efgh"),
                                 o.put_bytes(28, _lp(8184, o.LP_NORMAL, 2)), o.prune()],
    "prune_equal_offsets_with_gap": [o.init_page(16), o.insert(b"x" * 9), o.insert(b"y" * 3), o.insert(b"z"),
                                     o.put_bytes(32, _lp(8160, o.LP_NORMAL, 9)), o.delete(2), o.prune()],
    "prune_corrupt_tuple_lengths": [o.init_page(8144), o.insert(b"a" * 8), o.insert(b"b" * 8),
                                    o.put_bytes(24, _lp(32, o.LP_NORMAL, 16) * 2), o.prune()],
    "prune_all_dead_resets": _three() + [o.delete(1), o.delete(2), o.delete(3), o.prune(), o.insert(b"new")],
    "prune_garbage_and_append": [o.init_page(8), o.insert(b"k"), o.append(b"Z" * 9), o.put_bytes(8177, b"\x66"),
                                 o.put_bytes(8186, b"\x55"), o.prune()],
    "unaligned_upper_insert": [o.init_page(0), o.put_bytes(14, struct.pack("<H", 8191)),
                               o.put_bytes(18, b"\x00\x00"), o.insert(b"z"), o.insert(b"zz"), o.prune()],
    "insert_exact_fill": [o.init_page(8104), o.insert(b"x" * 48), o.insert(b"y" * 8)],
    "insert_after_exact_fill_fails": [o.init_page(8104), o.insert(b"x" * 48), o.insert(b"y" * 8), o.insert(b"z")],
    "insert_page_full_by_slot": [o.init_page(8104), o.insert(b"x" * 57)],
    "insert_reuse_slot_no_pointer_space": [o.init_page(8104), o.insert(b"x" * 48), o.insert(b"y" * 4),
                                           o.put_bytes(14, struct.pack("<H", 40)), o.put_bytes(24, bytes(4)),
                                           o.insert(b"z" * 8)],
    "insert_explicit_new_slot": [o.init_page(0), o.insert(b"a", 1), o.insert(b"b", 2), o.delete(1), o.prune(),
                                 o.insert(b"c", 1)],
    "insert_explicit_skip_slot_fails": [o.init_page(0), o.insert(b"a", 2)],
    "update_elsewhere_exact_fit": [o.init_page(8136), o.insert(b"a"), o.put_bytes(14, struct.pack("<H", 44)),
                                   o.update(1, b"b" * 16)],
    "update_elsewhere_too_big": [o.init_page(8136), o.insert(b"a"), o.put_bytes(14, struct.pack("<H", 44)),
                                 o.update(1, b"b" * 17)],
    "update_in_place_shrinks": _three() + [o.update(1, b"xyz"), o.update(3, b"q" * 24)],
    "update_dead_fails": _three() + [o.delete(2), o.update(2, b"x")],
    "delete_twice_fails": _three() + [o.delete(3), o.delete(3)],
    "delete_slot_zero_fails": _three() + [o.delete(0)],
    "corrupt_lower_unaligned": _three() + [o.put_bytes(12, struct.pack("<H", 26)), o.insert(b"x")],
    "corrupt_special_unaligned": _three() + [o.put_bytes(16, struct.pack("<H", 8188)), o.prune()],
    "corrupt_upper_above_special": _three() + [o.put_bytes(14, struct.pack("<H", 8193)), o.append(b"x")],
    "corrupt_lower_below_header": _three() + [o.put_bytes(12, struct.pack("<H", 20)), o.delete(1)],
    "corrupt_pointer_below_upper": _three() + [o.put_bytes(24, _lp(100, o.LP_NORMAL, 4)), o.update(1, b"x")],
    "corrupt_pointer_past_special": _three() + [o.put_bytes(32, _lp(8184, o.LP_NORMAL, 9)), o.prune()],
    "corrupt_pointer_zero_len": _three() + [o.put_bytes(28, _lp(8168, o.LP_NORMAL, 0)), o.delete(2)],
    "unchecked_dead_pointer": _three() + [o.put_bytes(24, _lp(5, o.LP_DEAD, 9)), o.delete(2), o.prune()],
    "raw_bytes_on_zero_page": [o.set_bits(4000, b"\x81\x42"), o.clear_bits(4000, b"\x01"), o.put_bytes(8191, b"\x7f")],
    "insert_on_zero_page_fails": [o.insert(b"no header")],
    "lsn_wins_over_put_bytes": [o.put_bytes(0, b"\xff" * 24)],
    "byte_range_end_of_page": [o.init_page(0), o.set_bits(8191, b"\x01"), o.set_bits(8191, b"\x01\x01")],
    "init_bad_special_fails": [o.init_page(0), o.init_page(8176)],
    "init_special_8168_then_append_fails": [o.init_page(8168), o.append(b"a")],
    "reinit_discards_page": _three() + [o.init_page(24), o.insert(b"fresh")],
    # records that cannot be decoded (bad_record in the child): ingest stores them, redo fails
    "bad_record_reserved_kind": [o.init_page(0), o.insert(b"a"), b"\x10\x00\x00"],
    "bad_record_kind_zero": [o.init_page(0), b"\x00"],
    "bad_record_unknown_kind": [o.init_page(0), b"\x0a\x00\x01x"],
    "bad_record_init_long_body": [o.init_page(0), bytes.fromhex("01000000")],
    "bad_record_delete_short_body": [o.init_page(0), o.insert(b"a"), bytes.fromhex("0400")],
    "bad_record_prune_with_body": [o.init_page(0), bytes.fromhex("0500")],
    "bad_record_insert_without_data": [o.init_page(0), bytes.fromhex("020000")],
    "bad_record_append_without_data": [o.init_page(0), bytes.fromhex("09")],
}

IMAGE_SCENARIOS = {
    "image_all_ff_then_init": [(I, b"\xff" * 8192), (R, o.set_bits(10, b"\x01")), (R, o.init_page(0)),
                               (R, o.insert(b"t"))],
    "image_all_ff_then_insert_fails": [(I, b"\xff" * 8192), (R, o.insert(b"t"))],
    "image_with_free_space_garbage": [
        (I, o.redo(None, [(1, o.init_page(0)), (2, o.insert(b"img")), (3, o.put_bytes(5000, b"junk" * 4))])),
        (R, o.insert(b"x" * 30)), (R, o.update(1, b"IMG!!!!!!!!")), (R, o.prune()),
    ],
    "image_then_image": [(I, bytes(8192)), (R, o.put_bytes(100, b"a")), (I, bytes([3]) * 8192),
                         (R, o.put_bytes(101, b"b"))],
}


def _ingest_scenarios(conn, scenarios, base_lsn):
    rs = o.RecordSet()
    keys = {}
    lsn = base_lsn
    for i, name in enumerate(sorted(scenarios)):
        key = Key.rel_block(13000, i)
        keys[name] = key
        for kind, data in scenarios[name]:
            rs.add(key, lsn, kind, data)
            lsn += 3
    values = [(k, v.lsn, v.kind, v.data) for k in rs.keys() for v in rs.values[k]]
    values.sort(key=lambda v: v[1])
    conn.ingest(values)
    return rs, keys


@pytest.mark.parametrize("base_lsn", [0x100, 0x1_2345_6780], ids=["low_lsn", "lsn_above_2^32"])
def test_edge_case_histories_match_oracle(pageserver, process_kind, tenant, base_lsn):
    pageserver.allowed_errors.append(
        r"failed to reconstruct a page: redo rejected by walredo process \((apply_failed|bad_record)\)")
    scenarios = {name: [(R, rec) for rec in recs] for name, recs in SCENARIOS.items()}
    scenarios.update(IMAGE_SCENARIOS)
    with pageserver.connect(tenant) as conn:
        rs, keys = _ingest_scenarios(conn, scenarios, base_lsn)
        requests = [(k, lsn) for k in keys.values() for lsn in rs.lsns(k)] + [(k, LATEST) for k in keys.values()]
        verify(conn, rs, requests)
    # the scenarios cover both outcomes
    outcomes = {name: _outcome(rs, k) for name, k in keys.items()}
    assert "redo_failed" in outcomes.values() and "page" in outcomes.values()
    assert outcomes["prune_corrupt_tuple_lengths"] == "redo_failed"
    assert outcomes["prune_overlapping_tuples"] == "page"
    assert outcomes["bad_record_reserved_kind"] == "redo_failed"


def _outcome(rs, key):
    try:
        rs.get_page(key, LATEST)
        return "page"
    except o.RedoError:
        return "redo_failed"
