# The board's msgpack codec: the subset of msgpack the wire contract uses, with the
# limits of docs/PROTOCOL.md ("Limits", "Errors") checked before anything is allocated.
# It runs on MicroPython and unchanged on CPython, and encodes byte for byte what
# `msgpack.packb` (msgpack >= 1.0 defaults) produces, so board and bridge agree on bytes.
import struct

try:
    from micropython import const
except ImportError:
    def const(x):
        return x


# Wire numbers: msgpack header bytes (https://github.com/msgpack/msgpack/blob/master/spec.md).
_FIXMAP = const(0x80)
_FIXARRAY = const(0x90)
_FIXSTR = const(0xa0)
_NIL = const(0xc0)
_NEVER = const(0xc1)
_FALSE = const(0xc2)
_TRUE = const(0xc3)
_BIN8 = const(0xc4)
_BIN16 = const(0xc5)
_BIN32 = const(0xc6)
_EXT8 = const(0xc7)
_EXT16 = const(0xc8)
_EXT32 = const(0xc9)
_FLOAT32 = const(0xca)
_FLOAT64 = const(0xcb)
_UINT8 = const(0xcc)
_UINT16 = const(0xcd)
_UINT32 = const(0xce)
_UINT64 = const(0xcf)
_INT8 = const(0xd0)
_INT16 = const(0xd1)
_INT32 = const(0xd2)
_INT64 = const(0xd3)
_FIXEXT1 = const(0xd4)
_FIXEXT2 = const(0xd5)
_FIXEXT4 = const(0xd6)
_FIXEXT8 = const(0xd7)
_FIXEXT16 = const(0xd8)
_STR8 = const(0xd9)
_STR16 = const(0xda)
_STR32 = const(0xdb)
_ARRAY16 = const(0xdc)
_ARRAY32 = const(0xdd)
_MAP16 = const(0xde)
_MAP32 = const(0xdf)
_NEGFIX = const(0xe0)
# Where the "fix" families end: the value or length fits in the header byte below these.
_FIXINT_END = const(0x80)
_FIXSTR_END = const(0x20)
# A str of this many bytes or more is lent to encode_parts' output, not copied into it.
_LEND = const(256)

# What a header announces; the reader loop branches on these instead of on header bytes.
# Multiples of 16: a row of _HEAD is a kind plus an index into _ARGS.
_K_VALUE = const(0x00)  # a scalar: nil, bool, int, float
_K_STR = const(0x10)
_K_BIN = const(0x20)
_K_ARRAY = const(0x30)
_K_MAP = const(0x40)
_K_BAD = const(0x50)  # a byte the contract does not use

# Limits of PROTOCOL.md "Limits"; configuration may pass others per call.
MAX_PAYLOAD = 16384
MAX_STR = 8192  # str and bin alike
MAX_ITEMS = 256  # array elements, map entries
MAX_DEPTH = 16  # nested arrays/maps; a top-level container is depth 1


class CodecError(ValueError):
    # `kind` is the error kind of PROTOCOL.md "Errors", so the board's `error` event
    # and the bridge's refusal name the same thing.
    kind = "codec"


class Truncated(CodecError):
    kind = "truncated"


class TooLarge(CodecError):
    kind = "too_large"


class TooDeep(CodecError):
    kind = "too_deep"


class BadType(CodecError):
    kind = "bad_type"


# --------------------------------------------------------------------------- decoding

# Header byte -> what it announces, for 0xc0..0xdf, the headers that are not "fix"
# families: _HEAD[byte - 0xc0] is a kind plus an index i. `_SIZES[i]` bytes follow the
# header and the struct format `_ARGS[i]` reads them: the value of a scalar, or the
# length/count of a str, bin, array or map. When nothing follows (size 0), _ARGS[i] is
# the value itself (nil, bool) or why the byte is refused. Bytes rather than a dict of
# tuples: one small object on the board heap, where the dict took 3.7 KiB (64-bit).
_ARGS = const((None, False, True, ">B", ">H", ">I", ">Q", ">b", ">h", ">i", ">q", ">f", ">d",
               "ext type", "reserved byte 0xc1"))
_SIZES = const(b"\x00\x00\x00\x01\x02\x04\x08\x01\x02\x04\x08\x04\x08\x00\x00")
_A_NIL = const(0)  # indexes into _ARGS and _SIZES
_A_FALSE = const(1)
_A_TRUE = const(2)
_A_U8 = const(3)
_A_U16 = const(4)
_A_U32 = const(5)
_A_U64 = const(6)
_A_I8 = const(7)
_A_I16 = const(8)
_A_I32 = const(9)
_A_I64 = const(10)
_A_F32 = const(11)
_A_F64 = const(12)
_A_EXT = const(13)
_A_RESERVED = const(14)
# A bytes literal, each byte's kind and index named beside it: bytes((...)) made at import
# kept its tuple of ints on the board heap too, in the module's constants (144 B, 32-bit).
_HEAD = const(
    b"\x00"  # 0xc0 nil: _K_VALUE | _A_NIL
    b"\x5e"  # 0xc1 never used: _K_BAD | _A_RESERVED
    b"\x01\x02"  # 0xc2 false, 0xc3 true: _K_VALUE | _A_FALSE, _A_TRUE
    b"\x23\x24\x25"  # 0xc4 bin 8, 16, 32: _K_BIN | _A_U8, _A_U16, _A_U32
    b"\x5d\x5d\x5d"  # 0xc7 ext 8, 16, 32: _K_BAD | _A_EXT
    b"\x0b\x0c"  # 0xca float 32, 64: _K_VALUE | _A_F32, _A_F64
    b"\x03\x04\x05\x06"  # 0xcc uint 8, 16, 32, 64: _K_VALUE | _A_U8 .. _A_U64
    b"\x07\x08\x09\x0a"  # 0xd0 int 8, 16, 32, 64: _K_VALUE | _A_I8 .. _A_I64
    b"\x5d\x5d\x5d\x5d\x5d"  # 0xd4 fixext 1, 2, 4, 8, 16: _K_BAD | _A_EXT
    b"\x13\x14\x15"  # 0xd9 str 8, 16, 32: _K_STR | _A_U8, _A_U16, _A_U32
    b"\x34\x35"  # 0xdc array 16, 32: _K_ARRAY | _A_U16, _A_U32
    b"\x44\x45"  # 0xde map 16, 32: _K_MAP | _A_U16, _A_U32
)

# 0x80..0xbf by high nibble: fixmap, fixarray, fixstr (two nibbles). Their count sits in
# the header's low bits, so they need no table row per byte.
_FIX_KIND = const((_K_MAP, _K_ARRAY, _K_STR, _K_STR))

# Well-formed UTF-8 (Unicode 15, table 3-7): lead byte range -> continuation bytes and
# the range allowed for the FIRST of them (later ones are always 0x80..0xbf). Those
# narrow first ranges are what exclude overlong forms, surrogates and code points past
# U+10FFFF. Five bytes a row (first lead, last lead, continuation bytes, lowest and
# highest first continuation): one object on the board heap, where eight tuples took
# about 600 bytes (64-bit).
_UTF8 = const(
    b"\xc2\xdf\x01\x80\xbf"
    b"\xe0\xe0\x02\xa0\xbf"
    b"\xe1\xec\x02\x80\xbf"
    b"\xed\xed\x02\x80\x9f"
    b"\xee\xef\x02\x80\xbf"
    b"\xf0\xf0\x03\x90\xbf"
    b"\xf1\xf3\x03\x80\xbf"
    b"\xf4\xf4\x03\x80\x8f"
)

# MicroPython's str() only checks the shape of UTF-8 and lets surrogates, overlong forms
# and code points past U+10FFFF through; CPython (the bridge) refuses them. Found out
# once here, so only a lax runtime pays for the strict check, and only on non-ASCII.
try:
    str(b"\xed\xa0\x80", "utf-8")
    _LAX_UTF8 = True
except UnicodeError:
    _LAX_UTF8 = False


def _strict_utf8(mv, pos, end):
    while pos < end:
        b = mv[pos]
        pos += 1
        if b < 0x80:
            continue
        for row in range(0, len(_UTF8), 5):
            if _UTF8[row] <= b <= _UTF8[row + 1]:
                break
        else:
            return False
        more = _UTF8[row + 2]
        if pos + more > end or not _UTF8[row + 3] <= mv[pos] <= _UTF8[row + 4]:
            return False
        for i in range(pos + 1, pos + more):
            if mv[i] & 0xc0 != 0x80:
                return False
        pos += more
    return True


# Marks a map that waits for a key rather than for the value of the key it holds.
_NOKEY = object()


def decode(data, max_payload=MAX_PAYLOAD, max_str=MAX_STR, max_items=MAX_ITEMS,
           max_depth=MAX_DEPTH):
    # One loop reads one header per turn. Open containers live on an explicit stack, not
    # in recursion, so the C stack use is the same whatever the nesting (a board has a
    # few KiB of it) and a depth limit raised by configuration stays safe.
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadType("payload must be bytes, not %s" % type(data).__name__)
    end = len(data)
    if end > max_payload:
        raise TooLarge("payload of %d bytes over %d" % (end, max_payload))
    # Slices of a memoryview share the payload, so a str or bin is copied exactly once.
    mv = memoryview(data)
    unpack_from = struct.unpack_from
    # The innermost open container is kept in locals (cont: the list or dict, left:
    # entries still to read, key: a map's key read so far, or _NOKEY); the ones around
    # it wait on `stack`, three slots each. left == 0 means no container is open.
    stack = []
    cont = None
    left = 0
    key = _NOKEY
    pos = 0
    while True:
        if pos >= end:
            raise Truncated("payload ends at byte %d before its declared contents" % pos)
        b = mv[pos]
        pos += 1
        if b < _FIXMAP:
            obj = b  # positive fixint: the header is the value
        elif b >= _NEGFIX:
            obj = b - 0x100  # negative fixint
        else:
            if b < _NIL:
                kind = _FIX_KIND[(b - _FIXMAP) >> 4]
                n = b & (0x1f if kind == _K_STR else 0x0f)
            else:
                row = _HEAD[b - _NIL]
                kind = row & 0xf0
                fmt = _ARGS[row & 15]
                size = _SIZES[row & 15]
                if kind == _K_BAD:
                    raise BadType("%s at byte %d is not used by the contract" % (fmt, pos - 1))
                if size > end - pos:
                    raise Truncated("payload ends inside the header at byte %d" % (pos - 1))
                n = unpack_from(fmt, mv, pos)[0] if size else fmt
                pos += size
            if kind == _K_VALUE:
                obj = n
            elif kind == _K_STR or kind == _K_BIN:
                # The declared length is judged before the bytes are looked for or
                # copied: a 4 GiB length is too_large, whatever the payload holds.
                if n > max_str:
                    raise TooLarge("str/bin of %d bytes over %d" % (n, max_str))
                if n > end - pos:
                    raise Truncated("payload ends inside a %d-byte str/bin" % n)
                if kind == _K_BIN:
                    obj = bytes(mv[pos:pos + n])
                else:
                    try:
                        obj = str(mv[pos:pos + n], "utf-8")
                    except UnicodeError:
                        obj = None
                    # A str as long as its bytes is ASCII and needs no second look.
                    if obj is None or (_LAX_UTF8 and len(obj) != n
                                       and not _strict_utf8(mv, pos, pos + n)):
                        raise BadType("str at byte %d is not valid UTF-8" % pos)
                pos += n
            else:
                if n > max_items:
                    raise TooLarge("array/map of %d entries over %d" % (n, max_items))
                if len(stack) >= 3 * max_depth:
                    raise TooDeep("nesting deeper than %d" % max_depth)
                # Every entry needs at least one byte (two for a map's key and value),
                # so a count the rest of the payload cannot hold is refused before the
                # list is sized by it.
                if (n * 2 if kind == _K_MAP else n) > end - pos:
                    raise Truncated("payload ends inside a %d-entry array/map" % n)
                # A list is sized once: growing it by appends fragments a small heap.
                obj = {} if kind == _K_MAP else [None] * n
                if n:
                    stack.append(cont)
                    stack.append(left)
                    stack.append(key)
                    cont = obj
                    left = n
                    key = _NOKEY
                    continue
        # A finished object fills the innermost open container; a container it
        # completes is in turn the finished object for the one around it.
        while left:
            if key is not _NOKEY:
                cont[key] = obj
                key = _NOKEY
            elif type(cont) is dict:
                if type(obj) is list or type(obj) is dict:
                    raise BadType("a map key must be hashable, not %s" % type(obj).__name__)
                key = obj
                break
            else:
                cont[len(cont) - left] = obj
            left -= 1
            if left:
                break
            obj = cont
            key = stack.pop()
            left = stack.pop()
            cont = stack.pop()
        if not left:
            if pos != end:
                raise BadType("%d trailing bytes after the object" % (end - pos))
            return obj


# --------------------------------------------------------------------------- encoding

# Header tables, one family after another: rows of three bytes, (bits, header byte,
# encoded size), a key fitting a row when it is under 1 << bits; a 0 byte ends a family.
# The first row the key fits is the smallest encoding, which is the one msgpack.packb
# picks. A size of 1 marks a fix family: the value (or length) is OR-ed into the header
# byte; otherwise the value follows the header byte, big-endian, in the rest of the size.
# One bytes object: as tuples of tuples (and the ints past 30 bits they held) the same
# tables took about 1 KB of the board heap (32-bit).
_HEADS = const(
    # _UINT: 0..127 fixint; uint 8, 16, 32, 64
    b"\x07\x00\x01" b"\x08\xcc\x02" b"\x10\xcd\x03" b"\x20\xce\x05" b"\x40\xcf\x09" b"\x00"
    # _NINT, keyed by -1 - value so -1 is 0: -1..-32 negative fixint; int 8, 16, 32, 64
    b"\x05\xe0\x01" b"\x07\xd0\x02" b"\x0f\xd1\x03" b"\x1f\xd2\x05" b"\x3f\xd3\x09" b"\x00"
    # _STR: fixstr; str 8, 16, 32
    b"\x05\xa0\x01" b"\x08\xd9\x02" b"\x10\xda\x03" b"\x20\xdb\x05" b"\x00"
    # _BIN: bin 8, 16, 32
    b"\x08\xc4\x02" b"\x10\xc5\x03" b"\x20\xc6\x05" b"\x00"
    # _ARRAY: fixarray; array 16, 32
    b"\x04\x90\x01" b"\x10\xdc\x03" b"\x20\xdd\x05" b"\x00"
    # _MAP: fixmap; map 16, 32
    b"\x04\x80\x01" b"\x10\xde\x03" b"\x20\xdf\x05" b"\x00"
)
_UINT = const(0)  # where each family starts in _HEADS
_NINT = const(16)
_STR = const(32)
_BIN = const(45)
_ARRAY = const(55)
_MAP = const(65)

# The UTF-8 bytes of a str without copying them where the runtime allows: MicroPython
# keeps str as UTF-8 and lends it out as a view, so an 8 KiB text is not duplicated on
# the heap just to be written once. CPython has to encode.
try:
    memoryview("")
    _utf8 = memoryview
except TypeError:
    _utf8 = str.encode

# Types the encoder dispatches on by identity, which is several times cheaper on
# MicroPython than a chain of isinstance; a subclass is dispatched as the first of them it
# is an instance of. nil and bool are not here: only _small writes them.
_EXACT = (str, int, dict, list, tuple, float, bytes, bytearray, memoryview)


class Raw:
    # A value encoded already (`data`, msgpack bytes): written as those bytes, and lent
    # by encode_parts rather than copied. What a run sends in every model call unchanged
    # (its tools) is encoded once, and costs neither a tree of dicts on the heap for the
    # whole run nor room in each call's block.

    def __init__(self, data):
        self.data = data


class Encoder:
    # Writes payloads into one buffer in place: its own of `size` bytes, or `buf`. With
    # size None it has no buffer and only counts: the same walk as writing, so what
    # encode_parts allocates is exactly what it then writes (size()).

    def __init__(self, size=MAX_PAYLOAD, max_depth=MAX_DEPTH, buf=None):
        if buf is None and size is not None:
            buf = bytearray(size)
        self._buf = buf
        # (offset, bytes) of each long str or bin written as its header alone, and of
        # each Raw: see encode_parts. None: everything is written whole.
        self._lent = None
        self.max_depth = max_depth  # _limit is set by each walk (_pack)

    def pack(self, obj, limit=None):
        # The view is into the buffer: valid until the next pack, copy it to keep it.
        # `limit` caps the output below the buffer size (a board's configured payload).
        return memoryview(self._buf)[:self._pack(obj, len(self._buf) if limit is None else limit)]

    def _pack(self, obj, limit):
        # Where obj's encoding ends: written into the buffer, or only counted. Past
        # `limit` bytes it is TooLarge, found as soon as the walk gets there.
        self._limit = limit if self._buf is None else min(limit, len(self._buf))
        end = self._small(obj, 0)
        return end if end >= 0 else self._put(obj, 0, self.max_depth)

    def _full(self):
        return TooLarge("encoding over %d bytes" % self._limit)

    # The methods a value's walk calls for each value keep their frames within 11 words
    # of locals and stack, which MicroPython keeps on the C stack; past that each call
    # puts its frame on the heap (over 200 bytes on 64 bits). _put's frame is there (it
    # is the recursion into containers): called for every value, two walks per message,
    # it made an event of five fields cost 9.3 KB of allocation on the 64-bit unix port,
    # and a 128 KiB board collected about once per event. With _small and _head taking
    # the values, 1.9 KB (micropython.mem_total; test_codec keeps a ceiling).

    def _head(self, pos, at, key, value):
        # The header of the first row of the family at `at` in _HEADS that key fits, and
        # the value written into it or after it.
        while key >> _HEADS[at]:
            at += 3
            if not _HEADS[at]:
                # Past the widest row there is no msgpack encoding at all (an int beyond
                # 64 bits, which msgpack.packb refuses too): a type the contract cannot carry.
                raise BadType("%d does not fit a msgpack header" % value)
        key = _HEADS[at + 2]  # from here, the encoded size
        if pos + key > self._limit:
            raise self._full()
        if self._buf is not None:
            self._buf[pos] = _HEADS[at + 1] | (value & 0xff) if key == 1 else _HEADS[at + 1]
            while key > 1:
                key -= 1
                self._buf[pos + key] = value & 0xff
                value >>= 8
        return pos + _HEADS[at + 2]

    def _small(self, obj, pos):
        # Where obj's encoding ends if it is one of the values most of a message is made
        # of: a str under 256 bytes (not one to lend), an int, nil, true or false. -1
        # for anything else, which _put writes.
        t = type(obj)
        if t is str:
            obj = _utf8(obj)
            t = len(obj)
            if t > 0xff or (self._lent is not None and t >= self._lend):
                return -1
            if t < _FIXSTR_END:
                if pos + 1 + t > self._limit:
                    raise self._full()
                if self._buf is not None:
                    self._buf[pos] = _FIXSTR | t
                    self._buf[pos + 1:pos + 1 + t] = obj
                return pos + 1 + t
            if pos + 2 + t > self._limit:
                raise self._full()
            if self._buf is not None:
                self._buf[pos] = _STR8
                self._buf[pos + 1] = t
                self._buf[pos + 2:pos + 2 + t] = obj
            return pos + 2 + t
        if t is int:
            if obj < 0:
                return self._head(pos, _NINT, -1 - obj, obj)
            if obj >= _FIXINT_END:
                return self._head(pos, _UINT, obj, obj)
        elif obj is None:
            obj = _NIL
        elif obj is True:
            obj = _TRUE
        elif obj is False:
            obj = _FALSE
        else:
            return -1
        if pos >= self._limit:
            raise self._full()
        if self._buf is not None:
            self._buf[pos] = obj
        return pos + 1

    def _put(self, obj, pos, room):
        # What _small leaves: containers, floats, bins, a Raw, a str of 256 bytes or more
        # or one to lend, and values of subclasses. Recursion is bounded by `room`
        # (levels of nesting left), which is checked before each descent, so a cyclic or
        # hostile object stops at max_depth.
        t = type(obj)
        if t is Raw:
            obj = obj.data
            at = None  # no header: the bytes are an encoding already
        else:
            if t not in _EXACT:
                for t in _EXACT:
                    if isinstance(obj, t):
                        break
                else:
                    raise BadType("cannot encode %s" % type(obj).__name__)
            if t is dict or t is list or t is tuple:
                if room < 1:
                    raise TooDeep("nesting deeper than %d" % self.max_depth)
                room -= 1
                n = len(obj)
                if t is dict:
                    pos = self._head(pos, _MAP, n, n)
                    # Keys then lookups, not items(): MicroPython builds a tuple per item.
                    for k in obj:
                        end = self._small(k, pos)
                        pos = end if end >= 0 else self._put(k, pos, room)
                        end = self._small(obj[k], pos)
                        pos = end if end >= 0 else self._put(obj[k], pos, room)
                else:
                    pos = self._head(pos, _ARRAY, n, n)
                    for item in obj:
                        end = self._small(item, pos)
                        pos = end if end >= 0 else self._put(item, pos, room)
                return pos
            if t is float:
                # Always float64, as msgpack.packb does by default: float32 loses digits.
                if pos + 9 > self._limit:
                    raise self._full()
                if self._buf is not None:
                    struct.pack_into(">Bd", self._buf, pos, _FLOAT64, obj)
                return pos + 9
            if t is int:
                # An int of a subclass: _small takes int itself.
                if obj < 0:
                    return self._head(pos, _NINT, -1 - obj, obj)
                return self._head(pos, _UINT, obj, obj)
            if t is str:
                obj = _utf8(obj)
                at = _STR
            else:
                # bytes, bytearray, memoryview. A CPython view of wider items is written
                # as its raw bytes, as msgpack does.
                if getattr(obj, "itemsize", 1) != 1:
                    obj = bytes(obj)
                at = _BIN
        # A str, a bin or a Raw's bytes. A long str or bin is lent (see encode_parts), and
        # so is a Raw: its writer uses the parts before it changes them (a checkpoint's
        # ring of encoded events).
        n = len(obj)
        if self._lent is not None and (at is None or n >= self._lend):
            if at is not None:
                pos = self._head(pos, at, n, n)
            self._lent.append((pos, obj))
            return pos
        if at is not None:
            # Judged before the header too, so a huge str fails fast and never reaches
            # a row.
            if pos + n >= self._limit:
                raise self._full()
            pos = self._head(pos, at, n, n)
        if pos + n > self._limit:
            raise self._full()
        if self._buf is not None:
            self._buf[pos:pos + n] = obj
        return pos + n


# A bound for a walk that only counts: past any payload, within a small int anywhere.
_UNBOUNDED = const(0x3fffffff)


def size(obj, max_depth=MAX_DEPTH):
    # The encoded length of obj: Encoder's walk without a buffer.
    return Encoder(None, max_depth)._pack(obj, _UNBOUNDED)


def encode_parts(obj, max_payload=MAX_PAYLOAD, max_depth=MAX_DEPTH, lend=_LEND):
    # The encoding as a list of buffers that, written one after another, are the
    # payload. A str of _LEND bytes or more is not copied in but lent: its UTF-8 (a
    # view of the str itself on MicroPython) is one of the parts. A model call carries
    # the whole conversation — texts the run holds anyway — so this way it costs a small
    # buffer for its structure instead of a second copy of every text in one block,
    # which a fragmented board heap may not have. Strs are immutable: the parts stay
    # valid for as long as they are kept (a QoS 1 resend); so are a Raw's bytes.
    # `lend`: the shortest str lent. Lower, more parts and a smaller block for the
    # rest: what a fragmented heap may still have (Runtime.publish_msg's second try).
    # None: nothing is lent, and the one part is the whole payload (encode_exact).
    enc = Encoder(None, max_depth)
    if lend is not None:
        enc._lent = []
        enc._lend = lend
    n = enc._pack(obj, max_payload)  # the buffer's bytes: lent ones are not in it
    if enc._lent:
        total = n
        for _, data in enc._lent:
            total += len(data)
        if total > max_payload:
            raise TooLarge("encoding of %d bytes over %d" % (total, max_payload))
        enc._lent = []
    # The same encoder writes what it counted, into a buffer of that size.
    enc._buf = bytearray(n)
    enc._pack(obj, n)
    if not enc._lent:
        return [enc._buf]
    mv = memoryview(enc._buf)
    parts = []
    prev = 0
    for pos, data in enc._lent:
        if pos > prev:
            parts.append(mv[prev:pos])
        parts.append(data)
        prev = pos
    if prev < n:
        parts.append(mv[prev:])
    return parts


def encode_exact(obj, max_payload=MAX_PAYLOAD, max_depth=MAX_DEPTH):
    # A new bytearray of exactly the encoded size, the caller's to keep. The board
    # encodes everything it sends this way: the link keeps the payload until its
    # PUBACK anyway, so encoding straight into that one allocation needs no buffer
    # reserved for the largest payload and no second copy of each message.
    return encode_parts(obj, max_payload, max_depth, None)[0]


def encode(obj, max_payload=MAX_PAYLOAD, max_depth=MAX_DEPTH):
    return bytes(encode_exact(obj, max_payload, max_depth))
