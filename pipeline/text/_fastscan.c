/* _fastscan: the Layer-0 single-pass scanner and simhash index, in plain CPython C API.
 *
 * One pass over the str's code units (UCS1/UCS2/UCS4 as CPython stores them, so every index is
 * a character offset) yields what the six default checks need: placeholder hits, paragraph spans
 * with their 64-bit word-3-gram simhash, heading title spans and delimiter statistics outside
 * strings, comments, code fences and inline code spans. The pure-Python reference with identical
 * semantics is pipeline/contract/_scan.py (and pipeline/text/simhash.py); tests cross-check the two.
 * Definitions (whitespace, word characters, strings per format) are documented there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* ---- modes and flags (mirrored in _scan.py) ---------------------------------------------- */
enum { M_OTHER = 0, M_MD = 1, M_LATEX = 2, M_PY = 3, M_JSON = 4 };
enum { W_PLACEHOLDERS = 1, W_PARAS = 2, W_HEADINGS = 4, W_DELIMS = 8 };

#define F_SPACE 1
#define F_W 2
#define F_SPECIAL 4
#define F_TRIG 8
#define F_RARE 16

static unsigned char CLS[256];
static unsigned char RTAB[5][256];
/* PFX[c] has bit (c2 & 63) set, and PFXHI[c] == c2 >> 6, when "c c2" starts a placeholder
 * (every such second letter of one first letter lies in the same 64-character block) */
static uint64_t PFX[256];
static unsigned char PFXHI[256]; /* CLS plus F_RARE: the characters each mode must look at */

static inline unsigned cls_of(Py_UCS4 c) {
    if (c < 256) return CLS[c];
    return (Py_UNICODE_ISSPACE(c) ? F_SPACE : 0) | ((Py_UNICODE_ISALNUM(c) || c == '_') ? F_W : 0);
}

/* ---- hashing (identical constants in simhash.py) ----------------------------------------- */
#define WORD_SEED 0xcbf29ce484222325ULL
#define WORD_MUL 0x9e3779b97f4a7c15ULL
/* word hash: h = rotl(h, 7) ^ (code point * WORD_MUL) per character, ASCII folded: a 2-cycle
 * dependency per character, where a multiply chain (FNV) would cost 4 */
static uint64_t MUL[256];

static inline uint64_t fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t shingle3(uint64_t a, uint64_t b, uint64_t c) {
    return fmix64(a ^ rotl64(b, 21) ^ rotl64(c, 42));
}
static inline Py_UCS4 fold(Py_UCS4 c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

/* Simhash accumulator: 8-bit SWAR lanes (one uint64 per feature byte, one lane per bit), flushed
 * into 32-bit counters every 255 features. 8 table look-ups per feature instead of 64 bit tests. */
static uint64_t SPREAD[256];

typedef struct {
    uint64_t acc[8];
    uint32_t cnt[64];
    uint32_t pending;
    uint64_t nfeat;
} Acc;

static inline void acc_reset(Acc *a) { memset(a, 0, sizeof(*a)); }
static inline void acc_flush(Acc *a) {
    for (int k = 0; k < 8; k++) {
        uint64_t v = a->acc[k];
        for (int j = 0; j < 8; j++) a->cnt[8 * k + j] += (uint32_t)((v >> (8 * j)) & 0xff);
        a->acc[k] = 0;
    }
    a->pending = 0;
}
static inline void acc_add(Acc *a, uint64_t s) {
    a->acc[0] += SPREAD[s & 0xff];
    a->acc[1] += SPREAD[(s >> 8) & 0xff];
    a->acc[2] += SPREAD[(s >> 16) & 0xff];
    a->acc[3] += SPREAD[(s >> 24) & 0xff];
    a->acc[4] += SPREAD[(s >> 32) & 0xff];
    a->acc[5] += SPREAD[(s >> 40) & 0xff];
    a->acc[6] += SPREAD[(s >> 48) & 0xff];
    a->acc[7] += SPREAD[(s >> 56) & 0xff];
    a->nfeat++;
    if (++a->pending == 255) acc_flush(a);
}
static inline uint64_t acc_final(Acc *a) {
    acc_flush(a);
    uint64_t fp = 0;
    for (int b = 0; b < 64; b++)
        if (2 * (uint64_t)a->cnt[b] > a->nfeat) fp |= (1ULL << b);
    return fp;
}

/* ---- placeholder patterns (same table in _scan.py); ' ' means one or more whitespace ------- */
typedef struct {
    const char *text;
    int ci; /* ASCII case-insensitive */
} Pat;
static const Pat PATS[] = {
    {"TODO", 0},        {"XXX", 0},         {"???", 0},          {"Lorem ipsum", 1},
    {"TBD", 0},         {"FIXME", 0},       {"TITLE GOES HERE", 1}, {"Author Name", 0},
    {"AUTHOR NAME", 0}, {"to be filled", 1},
};
#define N_PATS ((int)(sizeof(PATS) / sizeof(PATS[0])))
#define PAT_QQQ 2

/* ---- growable int64 buffer --------------------------------------------------------------- */
typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Vec;
static int vec_push(Vec *x, int64_t a) {
    if (x->n == x->cap) {
        Py_ssize_t cap = x->cap ? x->cap * 2 : 64;
        int64_t *nv = (int64_t *)realloc(x->v, (size_t)cap * sizeof(int64_t));
        if (!nv) return -1;
        x->v = nv;
        x->cap = cap;
    }
    x->v[x->n++] = a;
    return 0;
}

#define WCAP 1024

/* ---- scanner state ----------------------------------------------------------------------- */
typedef struct {
    int mode, want;
    Py_ssize_t n, min_words, max_hits;
    /* placeholders */
    Py_ssize_t total_hits;
    Vec hits; /* pid, start, end */
    /* words and paragraphs */
    int track_words;
    uint64_t wh, w1, w2;
    Py_ssize_t para_words, para_start, para_end;
    Acc acc;
    Vec paras; /* start, end, nwords, fp */
    /* lines */
    int excl;
    /* markdown */
    int in_fence;
    Py_UCS4 fch;
    Py_ssize_t flen, code_until, bt_until, esc_at;
    Py_ssize_t fail_line[33]; /* fail_line[r]: a closer of r backticks was not found before here */
    /* latex / python / json */
    int in_comment, str_state; /* 0 none, 1 single, 2 triple */
    Py_UCS4 str_q;
    Py_ssize_t skip_until;
    Vec heads; /* offset, title start, title end */
    /* words seen but not yet folded into the paragraph (flushed at line ends) */
    int nw;
    uint64_t wb_h[WCAP];
    Py_ssize_t line_first; /* first non-space of the current line */
    Py_ssize_t line_start;
    int tl; /* words of the current line are tracked */
    /* delimiters: per type opens, closes, depth, last_zero_rise, first_unmatched_close */
    int64_t d_open[3], d_close[3], d_depth[3], d_rise[3], d_unmatched[3];
    int failed;
} S;

#define RD(i) \
    (kind == PyUnicode_1BYTE_KIND ? (Py_UCS4)((const Py_UCS1 *)data)[i] \
     : kind == PyUnicode_2BYTE_KIND ? (Py_UCS4)((const Py_UCS2 *)data)[i] \
                                    : (Py_UCS4)((const Py_UCS4 *)data)[i])

#define INLINE static inline __attribute__((always_inline))

INLINE void end_para(S *s) {
    if (s->para_words >= s->min_words) {
        uint64_t fp = acc_final(&s->acc);
        if (vec_push(&s->paras, s->para_start) || vec_push(&s->paras, s->para_end) ||
            vec_push(&s->paras, s->para_words) || vec_push(&s->paras, (int64_t)fp))
            s->failed = 1;
    }
    if (s->para_words) acc_reset(&s->acc);
    s->para_words = 0;
}

INLINE void end_word(S *s) {
    uint64_t w = s->wh;
    if (s->para_words >= 2) acc_add(&s->acc, shingle3(s->w2, s->w1, w));
    s->w2 = s->w1;
    s->w1 = w;
    s->para_words++;
}

INLINE int is_space_at(const void *data, int kind, Py_ssize_t n, Py_ssize_t j) {
    return j < n && (cls_of(RD(j)) & F_SPACE);
}

INLINE void try_placeholders(S *s, const void *data, int kind, Py_ssize_t i, Py_UCS4 c0) {
    Py_ssize_t n = s->n;
    for (int p = 0; p < N_PATS; p++) {
        const char *t = PATS[p].text;
        int ci = PATS[p].ci;
        Py_UCS4 t0 = (Py_UCS4)(unsigned char)t[0];
        if (!(c0 == t0 || (ci && fold(c0) == fold(t0)))) continue;
        if (p == PAT_QQQ) continue;
        Py_ssize_t j = i + 1;
        int ok = 1;
        for (const char *q = t + 1; *q; q++) {
            if (*q == ' ') {
                if (!is_space_at(data, kind, n, j)) { ok = 0; break; }
                while (is_space_at(data, kind, n, j)) j++;
            } else {
                if (j >= n) { ok = 0; break; }
                Py_UCS4 c = RD(j);
                Py_UCS4 tc = (Py_UCS4)(unsigned char)*q;
                if (!(c == tc || (ci && c < 128 && fold(c) == fold(tc)))) { ok = 0; break; }
                j++;
            }
        }
        if (!ok) continue;
        if (j < n && (cls_of(RD(j)) & F_W)) continue;
        s->total_hits++;
        if (s->hits.n / 3 < s->max_hits) {
            if (vec_push(&s->hits, p) || vec_push(&s->hits, i) || vec_push(&s->hits, j)) s->failed = 1;
        }
        return;
    }
}

/* Markdown fence opener at line start i: up to 3 spaces, >= 3 backticks or tildes; a backtick
 * fence's info string may not contain a backtick. */
INLINE int fence_open_at(const void *data, int kind, Py_ssize_t n, Py_ssize_t i, Py_UCS4 *ch,
                         Py_ssize_t *len) {
    Py_ssize_t j = i, k = 0;
    while (k < 3 && j < n && RD(j) == ' ') { j++; k++; }
    if (j >= n) return 0;
    Py_UCS4 c = RD(j);
    if (c != '`' && c != '~') return 0;
    Py_ssize_t r = 0;
    while (j < n && RD(j) == c) { j++; r++; }
    if (r < 3) return 0;
    if (c == '`') {
        for (; j < n; j++) {
            Py_UCS4 d = RD(j);
            if (d == '\n') break;
            if (d == '`') return 0;
        }
    }
    *ch = c;
    *len = r;
    return 1;
}

INLINE int fence_close_at(const void *data, int kind, Py_ssize_t n, Py_ssize_t i, Py_UCS4 ch,
                          Py_ssize_t flen) {
    Py_ssize_t j = i, k = 0;
    while (k < 3 && j < n && RD(j) == ' ') { j++; k++; }
    Py_ssize_t r = 0;
    while (j < n && RD(j) == ch) { j++; r++; }
    if (r < flen) return 0;
    for (; j < n; j++) {
        Py_UCS4 d = RD(j);
        if (d == '\n') break;
        if (!(cls_of(d) & F_SPACE)) return 0;
    }
    return 1;
}

INLINE void push_head(S *s, Py_ssize_t off, Py_ssize_t ts, Py_ssize_t te) {
    if (vec_push(&s->heads, off) || vec_push(&s->heads, ts) || vec_push(&s->heads, te)) s->failed = 1;
}

/* ATX heading at line start i: up to 3 spaces, 1-6 '#', then space, tab, CR, LF or end. */
INLINE void atx_at(S *s, const void *data, int kind, Py_ssize_t i) {
    Py_ssize_t n = s->n, j = i, k = 0;
    while (k < 3 && j < n && RD(j) == ' ') { j++; k++; }
    Py_ssize_t off = j, r = 0;
    while (j < n && RD(j) == '#') { j++; r++; }
    if (r < 1 || r > 6) return;
    if (j < n) {
        Py_UCS4 c = RD(j);
        if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return;
    }
    Py_ssize_t e = j;
    while (e < n && RD(e) != '\n') e++;
    Py_ssize_t ts = j;
    while (ts < e && (cls_of(RD(ts)) & F_SPACE)) ts++;
    Py_ssize_t te = e;
    while (te > ts && (cls_of(RD(te - 1)) & F_SPACE)) te--;
    /* optional closing sequence: a run of '#' that is the whole title or follows a space/tab */
    Py_ssize_t h = te;
    while (h > ts && RD(h - 1) == '#') h--;
    if (h < te && (h == ts || RD(h - 1) == ' ' || RD(h - 1) == '\t')) {
        te = h;
        while (te > ts && (cls_of(RD(te - 1)) & F_SPACE)) te--;
    }
    push_head(s, off, ts, te);
}

/* \section, \subsection, \subsubsection (starred, optional [..]) with a {title} on one line. */
INLINE void section_at(S *s, const void *data, int kind, Py_ssize_t p) {
    static const char SEC[] = "section";
    Py_ssize_t n = s->n, j = p + 1;
    for (int k = 0; k < 2; k++) {
        if (j + 3 <= n && RD(j) == 's' && RD(j + 1) == 'u' && RD(j + 2) == 'b') j += 3;
        else break;
    }
    for (int k = 0; k < 7; k++) {
        if (j >= n || RD(j) != (Py_UCS4)SEC[k]) return;
        j++;
    }
    if (j < n && RD(j) == '*') j++;
    while (j < n && (RD(j) == ' ' || RD(j) == '\t')) j++;
    if (j < n && RD(j) == '[') {
        j++;
        while (j < n && RD(j) != ']' && RD(j) != '\n') j++;
        if (j >= n || RD(j) != ']') return;
        j++;
        while (j < n && (RD(j) == ' ' || RD(j) == '\t')) j++;
    }
    if (j >= n || RD(j) != '{') return;
    Py_ssize_t ts = ++j;
    int depth = 1;
    while (j < n && j - ts <= 1000) {
        Py_UCS4 c = RD(j);
        if (c == '\n') return;
        if (c == '\\') {
            if (j + 1 < n && RD(j + 1) != '\n') j += 2;
            else j += 1;
            continue;
        }
        if (c == '{') depth++;
        else if (c == '}') {
            if (--depth == 0) {
                push_head(s, p, ts, j);
                return;
            }
        }
        j++;
    }
}

INLINE void delim(S *s, Py_UCS4 c, Py_ssize_t i) {
    int t, open;
    switch (c) {
        case '(': t = 0; open = 1; break;
        case ')': t = 0; open = 0; break;
        case '[': t = 1; open = 1; break;
        case ']': t = 1; open = 0; break;
        case '{': t = 2; open = 1; break;
        case '}': t = 2; open = 0; break;
        default: return;
    }
    if (open) {
        s->d_open[t]++;
        if (s->d_depth[t]++ == 0) s->d_rise[t] = i;
    } else {
        s->d_close[t]++;
        if (s->d_depth[t] == 0) {
            if (s->d_unmatched[t] < 0) s->d_unmatched[t] = i;
        } else {
            s->d_depth[t]--;
        }
    }
}

/* Inline code span: a run of r (<= 32) backticks closes at the next maximal run of exactly r
 * backticks on the same line. Returns the end of the span, or -1 when the run is literal. */
INLINE Py_ssize_t code_span_end(S *s, const void *data, int kind, Py_ssize_t i, Py_ssize_t r) {
    Py_ssize_t n = s->n, j = i + r;
    if (r > 32) return -1;
    if (s->fail_line[r] > i) return -1;
    while (j < n) {
        Py_UCS4 c = RD(j);
        if (c == '\n') break;
        if (c == '`') {
            Py_ssize_t q = j;
            while (j < n && RD(j) == '`') j++;
            if (j - q == r) return j;
            continue;
        }
        j++;
    }
    s->fail_line[r] = j; /* no closer of this length before j (the line end) */
    return -1;
}

INLINE void line_begin(S *s, const void *data, int kind, Py_ssize_t i) {
    s->excl = 0;
    if (s->mode != M_MD) return;
    if (s->in_fence) {
        s->excl = 1;
        if (fence_close_at(data, kind, s->n, i, s->fch, s->flen)) s->in_fence = 0;
    } else if (fence_open_at(data, kind, s->n, i, &s->fch, &s->flen)) {
        s->in_fence = 1;
        s->excl = 1;
    } else if (s->want & W_HEADINGS) {
        atx_at(s, data, kind, i);
    }
    if (s->excl && s->track_words) end_para(s);
}

INLINE void special(S *s, const void *data, int kind, Py_ssize_t i, Py_UCS4 c) {
    Py_ssize_t n = s->n;
    switch (s->mode) {
        case M_MD:
            if (s->excl || i < s->code_until || s->esc_at == i) return;
            if (c == '\\') {
                if (i + 1 < n && !(cls_of(RD(i + 1)) & F_SPACE)) s->esc_at = i + 1;
                if (s->want & W_HEADINGS) section_at(s, data, kind, i);
            } else if (c == '`') {
                if (i < s->bt_until) return;
                Py_ssize_t r = 0;
                while (i + r < n && RD(i + r) == '`') r++;
                s->bt_until = i + r;
                Py_ssize_t e = code_span_end(s, data, kind, i, r);
                if (e >= 0) s->code_until = e;
            } else {
                delim(s, c, i);
            }
            return;
        case M_LATEX:
            if (s->in_comment || s->esc_at == i) return;
            if (c == '\\') {
                if (i + 1 < n && !(cls_of(RD(i + 1)) & F_SPACE)) s->esc_at = i + 1;
                if (s->want & W_HEADINGS) section_at(s, data, kind, i);
            } else if (c == '%') {
                s->in_comment = 1;
            } else {
                delim(s, c, i);
            }
            return;
        case M_PY:
            if (s->in_comment || i < s->skip_until) return;
            if (s->str_state) {
                if (s->esc_at == i) return;
                if (c == '\\') {
                    s->esc_at = i + 1;
                } else if (c == s->str_q) {
                    if (s->str_state == 1) {
                        s->str_state = 0;
                    } else if (i + 2 < n && RD(i + 1) == c && RD(i + 2) == c) {
                        s->str_state = 0;
                        s->skip_until = i + 3;
                    }
                } else if (c == '\n' && s->str_state == 1) {
                    s->str_state = 0;
                }
                return;
            }
            if (c == '#') {
                s->in_comment = 1;
            } else if (c == '\'' || c == '"') {
                s->str_q = c;
                if (i + 2 < n && RD(i + 1) == c && RD(i + 2) == c) {
                    s->str_state = 2;
                    s->skip_until = i + 3;
                } else {
                    s->str_state = 1;
                }
            } else {
                delim(s, c, i);
            }
            return;
        case M_JSON:
            if (s->str_state) {
                if (s->esc_at == i) return;
                if (c == '\\') s->esc_at = i + 1;
                else if (c == '"' || c == '\n') s->str_state = 0;
                return;
            }
            if (c == '"') s->str_state = 1;
            else delim(s, c, i);
            return;
        default:
            return;
    }
}

INLINE void qqq_run(S *s, const void *data, int kind, Py_ssize_t i) {
    Py_ssize_t n = s->n, j = i;
    if (i > 0 && RD(i - 1) == '?') return;
    while (j < n && RD(j) == '?') j++;
    if (j - i < 3) return;
    s->total_hits++;
    if (s->hits.n / 3 < s->max_hits) {
        if (vec_push(&s->hits, PAT_QQQ) || vec_push(&s->hits, i) || vec_push(&s->hits, j))
            s->failed = 1;
    }
}

INLINE void flush_words(S *s) {
    if (s->nw && s->para_words == 0) s->para_start = s->line_first;
    for (int k = 0; k < s->nw; k++) {
        s->wh = s->wb_h[k];
        end_word(s);
    }
    s->nw = 0;
}

INLINE unsigned wide_cls(Py_UCS4 c) {
    return (Py_UNICODE_ISSPACE(c) ? F_SPACE : 0) | ((Py_UNICODE_ISALNUM(c) || c == '_') ? F_W : 0);
}

/* One pass. Word hashing is branch-free (every character updates the running hash and the
 * pending-word slot; a word end only advances an index), so the hard-to-predict word
 * boundaries cost no branch; everything a check needs besides words (newlines, delimiters,
 * quotes, backticks, '?', a trigger letter at a word start) takes the rare path. */
/* A line ends at i ('\n' or the end of the text): fold its words into the paragraph. */
INLINE void line_end(S *s, const void *data, int kind, Py_ssize_t i) {
    Py_ssize_t a = s->line_start, e = i;
    while (a < i && (cls_of(RD(a)) & F_SPACE)) a++;
    int blank = a == i;
    if (!blank) {
        while (e > a && (cls_of(RD(e - 1)) & F_SPACE)) e--;
        s->line_first = a;
    }
    flush_words(s);
    if (!blank && s->tl) s->para_end = e;
    if (!s->excl && blank) end_para(s);
}

/* Everything but word hashing: newlines, specials, '?', placeholder starts. Out of line so the
 * hot loop keeps its few variables in registers. */
static __attribute__((noinline)) void rare_char(S *s, const void *data, int kind, Py_ssize_t i,
                                                Py_UCS4 c, unsigned x) {
    if (x & F_TRIG) {
        if (s->want & W_PLACEHOLDERS) try_placeholders(s, data, kind, i, c);
    } else if (c == '?') {
        if (s->want & W_PLACEHOLDERS) qqq_run(s, data, kind, i);
    } else {
        if ((s->want & (W_DELIMS | W_HEADINGS)) && s->mode != M_OTHER && (x & F_SPECIAL))
            special(s, data, kind, i, c);
        if (c == '\n') {
            if (s->track_words) line_end(s, data, kind, i);
            s->in_comment = 0;
            line_begin(s, data, kind, i + 1);
            s->line_start = i + 1;
            s->tl = s->track_words && !s->excl;
        }
    }
}

/* One pass. Word hashing is branch-free (every character updates the running hash and the
 * pending-word slot; a word end only advances an index), so hard-to-predict word boundaries
 * cost no branch; what else the checks need (newlines, delimiters, quotes, backticks, '?',
 * a word starting like a placeholder) is rare and handled out of line. */
INLINE void scan_impl(S *s, const void *data, int kind, const int track_words) {
    const Py_ssize_t n = s->n;
    const unsigned char *rt = RTAB[s->mode];
    uint64_t h = WORD_SEED;
    uint64_t *wb = s->wb_h;
    unsigned px = F_SPACE;
    int nw = 0;
    line_begin(s, data, kind, 0);
    s->line_start = 0;
    s->tl = track_words && !s->excl;
    unsigned tl = (unsigned)s->tl;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_UCS4 c = RD(i);
        unsigned x;
        uint64_t m;
        if (kind == PyUnicode_1BYTE_KIND || c < 256) {
            x = rt[c];
            m = MUL[c];
        } else {
            x = wide_cls(c);
            m = (uint64_t)c * WORD_MUL;
        }
        if (track_words) {
            /* arithmetic selects, not branches: a word boundary must not be a branch */
            const unsigned sp = x & F_SPACE;
            const uint64_t msp = (uint64_t)0 - (uint64_t)sp; /* all ones on whitespace */
            wb[nw] = h;
            nw += (int)(sp & ~px & tl);
            h = (WORD_SEED & msp) | ((rotl64(h, 7) ^ m) & ~msp);
            if (nw == WCAP) {
                s->nw = nw;
                s->line_first = s->line_start;
                while (cls_of(RD(s->line_first)) & F_SPACE) s->line_first++;
                flush_words(s);
                nw = 0;
            }
        }
        unsigned trig = x & F_TRIG & ~((px & F_W) << 2);
        if (trig) {
            /* only a word start whose first two letters begin a placeholder is worth a look */
            Py_UCS4 c2 = i + 1 < n ? RD(i + 1) : 0;
            trig = c2 < 128 && (PFX[c] & (1ULL << (c2 & 63))) && ((c2 >> 6) == PFXHI[c]);
        }
        if ((x & F_RARE) | trig) {
            s->nw = nw;
            rare_char(s, data, kind, i, c, x);
            nw = s->nw;
            tl = (unsigned)s->tl;
        }
        px = x;
    }
    if (track_words) {
        if (!(px & F_SPACE) && tl) wb[nw++] = h;
        s->nw = nw;
        line_end(s, data, kind, n);
        end_para(s);
    }
}

static void scan_dispatch(S *s, const void *data, int kind) {
    switch (kind) {
        case PyUnicode_1BYTE_KIND:
            if (s->track_words) scan_impl(s, data, PyUnicode_1BYTE_KIND, 1);
            else scan_impl(s, data, PyUnicode_1BYTE_KIND, 0);
            break;
        case PyUnicode_2BYTE_KIND:
            if (s->track_words) scan_impl(s, data, PyUnicode_2BYTE_KIND, 1);
            else scan_impl(s, data, PyUnicode_2BYTE_KIND, 0);
            break;
        default:
            if (s->track_words) scan_impl(s, data, PyUnicode_4BYTE_KIND, 1);
            else scan_impl(s, data, PyUnicode_4BYTE_KIND, 0);
            break;
    }
}

static PyObject *vec_to_list(Vec *v, int width, int last_unsigned) {
    Py_ssize_t rows = v->n / width;
    PyObject *out = PyList_New(rows);
    if (!out) return NULL;
    for (Py_ssize_t r = 0; r < rows; r++) {
        PyObject *t = PyTuple_New(width);
        if (!t) { Py_DECREF(out); return NULL; }
        for (int k = 0; k < width; k++) {
            int64_t x = v->v[r * width + k];
            PyObject *o = (last_unsigned && k == width - 1)
                              ? PyLong_FromUnsignedLongLong((unsigned long long)(uint64_t)x)
                              : PyLong_FromLongLong((long long)x);
            if (!o) { Py_DECREF(t); Py_DECREF(out); return NULL; }
            PyTuple_SET_ITEM(t, k, o);
        }
        PyList_SET_ITEM(out, r, t);
    }
    return out;
}

static PyObject *py_scan(PyObject *self, PyObject *args) {
    PyObject *text;
    int mode, want;
    Py_ssize_t min_words, max_hits;
    if (!PyArg_ParseTuple(args, "Uiinn", &text, &mode, &want, &min_words, &max_hits)) return NULL;
    if (mode < M_OTHER || mode > M_JSON) {
        PyErr_SetString(PyExc_ValueError, "unknown scan mode");
        return NULL;
    }
    S *s = (S *)calloc(1, sizeof(S));
    if (!s) return PyErr_NoMemory();
    s->mode = mode;
    s->want = want;
    s->n = PyUnicode_GET_LENGTH(text);
    s->min_words = min_words < 3 ? 3 : min_words;
    s->max_hits = max_hits < 0 ? 0 : max_hits;
    s->track_words = (want & W_PARAS) && (mode == M_MD || mode == M_LATEX);
    s->esc_at = -1;
    for (int t = 0; t < 3; t++) { s->d_rise[t] = -1; s->d_unmatched[t] = -1; }
    for (int r = 0; r < 33; r++) s->fail_line[r] = -1;
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_BEGIN_ALLOW_THREADS
    scan_dispatch(s, data, kind);
    Py_END_ALLOW_THREADS
    PyObject *res = NULL;
    if (s->failed) {
        PyErr_NoMemory();
    } else {
        PyObject *hits = vec_to_list(&s->hits, 3, 0);
        PyObject *paras = hits ? vec_to_list(&s->paras, 4, 1) : NULL;
        PyObject *heads = paras ? vec_to_list(&s->heads, 3, 0) : NULL;
        PyObject *delims = heads ? Py_BuildValue(
            "((LLLL)(LLLL)(LLLL))",
            (long long)s->d_open[0], (long long)s->d_close[0], (long long)s->d_rise[0],
            (long long)s->d_unmatched[0], (long long)s->d_open[1], (long long)s->d_close[1],
            (long long)s->d_rise[1], (long long)s->d_unmatched[1], (long long)s->d_open[2],
            (long long)s->d_close[2], (long long)s->d_rise[2], (long long)s->d_unmatched[2])
                                 : NULL;
        if (delims) res = Py_BuildValue("(NnNNN)", hits, s->total_hits, paras, heads, delims);
        else { Py_XDECREF(hits); Py_XDECREF(paras); Py_XDECREF(heads); }
    }
    free(s->hits.v);
    free(s->paras.v);
    free(s->heads.v);
    free(s);
    return res;
}

/* ---- fingerprint of a whole text: word 3-gram shingles, word features under 3 words ------- */
INLINE uint64_t fingerprint_impl(const void *data, int kind, Py_ssize_t n) {
    Acc a;
    acc_reset(&a);
    uint64_t words[2] = {0, 0}, wh = WORD_SEED, w1 = 0, w2 = 0;
    Py_ssize_t nw = 0;
    int in_word = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        int space = (i == n) || (cls_of(RD(i)) & F_SPACE);
        if (space) {
            if (!in_word) continue;
            uint64_t w = wh;
            if (nw < 2) words[nw] = w;
            if (nw >= 2) acc_add(&a, shingle3(w2, w1, w));
            w2 = w1;
            w1 = w;
            nw++;
            in_word = 0;
        } else {
            if (!in_word) { in_word = 1; wh = WORD_SEED; }
            wh = rotl64(wh, 7) ^ ((uint64_t)fold(RD(i)) * WORD_MUL);
        }
    }
    if (nw == 0) return 0;
    if (nw < 3)
        for (Py_ssize_t k = 0; k < nw; k++) acc_add(&a, words[k]);
    return acc_final(&a);
}

static PyObject *py_fingerprint(PyObject *self, PyObject *args) {
    PyObject *text;
    if (!PyArg_ParseTuple(args, "U", &text)) return NULL;
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    uint64_t fp;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
        case PyUnicode_1BYTE_KIND: fp = fingerprint_impl(data, PyUnicode_1BYTE_KIND, n); break;
        case PyUnicode_2BYTE_KIND: fp = fingerprint_impl(data, PyUnicode_2BYTE_KIND, n); break;
        default: fp = fingerprint_impl(data, PyUnicode_4BYTE_KIND, n); break;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong((unsigned long long)fp);
}

/* ---- near-duplicate index ---------------------------------------------------------------
 * Multi-index hashing: 64 bits cut into B = k + r blocks; a pair within Hamming distance k
 * differs in at most k blocks, so it agrees on at least r of them (pigeonhole), and every
 * r-combination of blocks is one table. Exact: every pair within k is found. r is chosen to
 * minimise tables * (n + expected same-key pairs). Mirrors simhash.py. */
typedef struct {
    int64_t i, j;
} Pair;

static int pair_cmp(const void *a, const void *b) {
    const Pair *x = (const Pair *)a, *y = (const Pair *)b;
    if (x->i != y->i) return x->i < y->i ? -1 : 1;
    if (x->j != y->j) return x->j < y->j ? -1 : 1;
    return 0;
}

/* Hardware popcount where the CPU has it: GCC builds a POPCNT clone of the index functions and
 * picks it at load time (ifunc); elsewhere the builtin's portable code is used. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define POPCNT_CLONES __attribute__((target_clones("popcnt", "default")))
#else
#define POPCNT_CLONES
#endif
#define pop64(x) __builtin_popcountll(x)

/* Number of blocks: k + 2 (exact: a pair within k differs in at most k blocks, so it agrees on
 * two) while a bucket holds about 8 random fingerprints or fewer; beyond that, fewer and wider
 * blocks so the 2-block keys grow with log2(n) and the work stays linear. Mirrors simhash.py. */
static int near_blocks(Py_ssize_t n, int k) {
    int exact = k + 2;
    if (exact > 64) exact = 64;
    double load_bits = n > 16 ? log2((double)n / 8.0) : 1.0;
    int b = (int)(128.0 / load_bits);
    if (b >= exact) return exact;
    return b < 3 ? 3 : b;
}

static int pair_push(Pair **pairs, Py_ssize_t *np, Py_ssize_t *cap, int64_t i, int64_t j) {
    if (*np == *cap) {
        Py_ssize_t nc = *cap ? *cap * 2 : 256;
        Pair *nv = (Pair *)realloc(*pairs, (size_t)nc * sizeof(Pair));
        if (!nv) return -1;
        *pairs = nv;
        *cap = nc;
    }
    (*pairs)[*np].i = i;
    (*pairs)[*np].j = j;
    (*np)++;
    return 0;
}

/* Stable counting sort of (idx, f)[0..g) by the block at (lo, w) into (oi, of). */
static void block_sort(const int32_t *idx, const uint64_t *f, Py_ssize_t g, int lo, int w,
                       int32_t *oi, uint64_t *of, int32_t *cnt) {
    const int nb = 1 << w;
    const uint64_t m = (1ULL << w) - 1;
    memset(cnt, 0, (size_t)(nb + 1) * sizeof(int32_t));
    for (Py_ssize_t x = 0; x < g; x++) cnt[((f[x] >> lo) & m) + 1]++;
    for (int b = 0; b < nb; b++) cnt[b + 1] += cnt[b];
    for (Py_ssize_t x = 0; x < g; x++) {
        int32_t pos = cnt[(f[x] >> lo) & m]++;
        oi[pos] = idx[x];
        of[pos] = f[x];
    }
}

/* The 2-block tables of narrow blocks (<= 8 bits), computed group by group: items are sorted
 * once by the first block, and each group (small, cache-resident) by the second, so every
 * table (b1, b2) is visited without touching the whole array again. Returns -1 on OOM. */
POPCNT_CLONES static int near_grouped(const uint64_t *fp, Py_ssize_t n, int k, int B, const int *blo,
                        const int *bw, const uint64_t *bmask, int all_pairs, int64_t *best,
                        Pair **pairs, Py_ssize_t *npairs, Py_ssize_t *cap) {
    int32_t *idx0 = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    int32_t *idx1 = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    int32_t *idx2 = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    uint64_t *f1 = (uint64_t *)malloc((size_t)n * sizeof(uint64_t));
    uint64_t *f2 = (uint64_t *)malloc((size_t)n * sizeof(uint64_t));
    int32_t cnt1[257], cnt2[257];
    int rc = 0;
    if (!idx0 || !idx1 || !idx2 || !f1 || !f2) rc = -1;
    for (Py_ssize_t x = 0; rc == 0 && x < n; x++) idx0[x] = (int32_t)x;
    for (int b1 = 0; rc == 0 && b1 < B - 1; b1++) {
        block_sort(idx0, fp, n, blo[b1], bw[b1], idx1, f1, cnt1);
        /* cnt1[v] is now the end of group v */
        Py_ssize_t g0 = 0;
        for (int v = 0; rc == 0 && v < (1 << bw[b1]); v++) {
            Py_ssize_t g1 = cnt1[v], g = g1 - g0;
            if (g >= 2) {
                for (int b2 = b1 + 1; rc == 0 && b2 < B; b2++) {
                    block_sort(idx1 + g0, f1 + g0, g, blo[b2], bw[b2], idx2, f2, cnt2);
                    uint64_t tblocks = (1ULL << b1) | (1ULL << b2);
                    Py_ssize_t s0 = 0;
                    for (int u = 0; rc == 0 && u < (1 << bw[b2]); u++) {
                        Py_ssize_t s1 = cnt2[u];
                        for (Py_ssize_t p = s0 + 1; p < s1; p++) {
                            const uint64_t f = f2[p];
                            const int64_t ip = idx2[p];
                            if (all_pairs) {
                                for (Py_ssize_t q = s0; q < p; q++) {
                                    uint64_t d = f2[q] ^ f;
                                    if (pop64(d) > k) continue;
                                    uint64_t first = 0;
                                    int got = 0;
                                    for (int bb = 0; bb < B && got < 2; bb++)
                                        if (!(d & bmask[bb])) { first |= (1ULL << bb); got++; }
                                    if (first != tblocks) continue;
                                    if (pair_push(pairs, npairs, cap, idx2[q], ip)) { rc = -1; break; }
                                }
                                if (rc) break;
                            } else {
                                int64_t cur = best[ip];
                                for (Py_ssize_t q = s0; q < p; q++) {
                                    int64_t iq = idx2[q];
                                    if (cur >= 0 && iq >= cur) break;
                                    if (pop64(f2[q] ^ f) <= k) { cur = iq; break; }
                                }
                                best[ip] = cur;
                            }
                        }
                        s0 = s1;
                    }
                }
            }
            g0 = g1;
        }
    }
    free(idx0);
    free(idx1);
    free(idx2);
    free(f1);
    free(f2);
    return rc;
}

static PyObject *py_near(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int k, all_pairs;
    if (!PyArg_ParseTuple(args, "y*ip", &buf, &k, &all_pairs)) return NULL;
    Py_ssize_t n = buf.len / 8;
    uint64_t *fp = (uint64_t *)malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    int64_t *best = (int64_t *)malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!fp || !best) {
        free(fp);
        free(best);
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    memcpy(fp, buf.buf, (size_t)n * 8);
    PyBuffer_Release(&buf);
    for (Py_ssize_t x = 0; x < n; x++) best[x] = -1;
    Pair *pairs = NULL;
    Py_ssize_t npairs = 0, cap = 0;
    int oom = 0;
    if (k < 0) k = -1;
#define ADD_PAIR(a, b)                                                            \
    do {                                                                          \
        if (npairs == cap) {                                                      \
            Py_ssize_t nc = cap ? cap * 2 : 256;                                  \
            Pair *np_ = (Pair *)realloc(pairs, (size_t)nc * sizeof(Pair));        \
            if (!np_) { oom = 1; break; }                                         \
            pairs = np_;                                                          \
            cap = nc;                                                             \
        }                                                                         \
        pairs[npairs].i = (a);                                                    \
        pairs[npairs].j = (b);                                                    \
        npairs++;                                                                 \
    } while (0)

    Py_BEGIN_ALLOW_THREADS
    if (k >= 0 && (n <= 256 || k >= 48)) {
        /* small inputs: the plain double loop is cheapest */
        for (Py_ssize_t j = 1; j < n && !oom; j++)
            for (Py_ssize_t i = 0; i < j; i++)
                if (pop64(fp[i] ^ fp[j]) <= k) {
                    if (all_pairs) { ADD_PAIR(i, j); if (oom) break; }
                    else { best[j] = i; break; }
                }
    } else if (k >= 0) {
        int r = 2, B = near_blocks(n, k);
        uint64_t bmask[64];
        int blo[64], bw[64];
        for (int b = 0; b < B; b++) {
            int lo = b * 64 / B, hi = (b + 1) * 64 / B;
            blo[b] = lo;
            bw[b] = hi - lo;
            bmask[b] = (hi - lo == 64) ? ~0ULL : (((1ULL << (hi - lo)) - 1) << lo);
        }
        if (B >= 8) {
            if (near_grouped(fp, n, k, B, blo, bw, bmask, all_pairs, best, &pairs, &npairs, &cap)) oom = 1;
        } else {
        int hb = 4;
        while (hb < 24 && ((Py_ssize_t)1 << hb) < 2 * n) hb++;
        Py_ssize_t nbmax = (Py_ssize_t)1 << 22;
        if (nbmax < ((Py_ssize_t)1 << hb)) nbmax = (Py_ssize_t)1 << hb;
        /* per table: chains of earlier fingerprints sharing a key, oldest first */
        int32_t *head = (int32_t *)malloc((size_t)nbmax * sizeof(int32_t));
        int32_t *tail = (int32_t *)malloc((size_t)nbmax * sizeof(int32_t));
        int32_t *next = (int32_t *)malloc((size_t)n * sizeof(int32_t));
        if (!head || !tail || !next) oom = 1;
        int comb[8];
        for (int q = 0; q < r; q++) comb[q] = q;
        while (!oom) {
            uint64_t tmask = 0, tblocks = 0;
            int kb = 0, lo1 = 0, w1 = 0, lo2 = 0, w2 = 0;
            for (int q = 0; q < r; q++) {
                tmask |= bmask[comb[q]];
                tblocks |= (1ULL << comb[q]);
                kb += bw[comb[q]];
            }
            lo1 = blo[comb[0]];
            w1 = bw[comb[0]];
            if (r == 2) { lo2 = blo[comb[1]]; w2 = bw[comb[1]]; }
            const int direct = kb <= 22, two = (r == 2 && direct);
            const uint64_t m1 = (1ULL << w1) - 1, m2 = (1ULL << w2) - 1;
            Py_ssize_t nb = direct ? ((Py_ssize_t)1 << kb) : ((Py_ssize_t)1 << hb);
            memset(head, 0xff, (size_t)nb * sizeof(int32_t));
            for (Py_ssize_t x = 0; x < n && !oom; x++) {
                const uint64_t f = fp[x];
                uint32_t h;
                if (two) {
                    h = (uint32_t)(((f >> lo1) & m1) | (((f >> lo2) & m2) << w1));
                } else if (direct) {
                    uint64_t key = 0;
                    int sh = 0;
                    for (int q = 0; q < r; q++) {
                        int b = comb[q];
                        key |= ((f >> blo[b]) & ((1ULL << bw[b]) - 1)) << sh;
                        sh += bw[b];
                    }
                    h = (uint32_t)key;
                } else {
                    h = (uint32_t)(((f & tmask) * 0x9E3779B97F4A7C15ULL) >> (64 - hb));
                }
                int32_t q = head[h];
                if (all_pairs) {
                    for (; q >= 0; q = next[q]) {
                        uint64_t d = fp[q] ^ f;
                        if ((d & tmask) || pop64(d) > k) continue;
                        /* report in the first table (lowest r agreeing blocks) only */
                        uint64_t first = 0;
                        int got = 0;
                        for (int bb = 0; bb < B && got < r; bb++)
                            if (!(d & bmask[bb])) { first |= (1ULL << bb); got++; }
                        if (first != tblocks) continue;
                        ADD_PAIR(q, x);
                        if (oom) break;
                    }
                } else {
                    int64_t cur = best[x];
                    for (; q >= 0 && (cur < 0 || q < cur); q = next[q]) {
                        uint64_t d = fp[q] ^ f;
                        if ((d & tmask) || pop64(d) > k) continue;
                        cur = q;
                        break;
                    }
                    best[x] = cur;
                }
                next[x] = -1;
                if (head[h] < 0) head[h] = (int32_t)x;
                else next[tail[h]] = (int32_t)x;
                tail[h] = (int32_t)x;
            }
            /* next combination */
            int q = r - 1;
            while (q >= 0 && comb[q] == B - r + q) q--;
            if (q < 0) break;
            comb[q]++;
            for (int z = q + 1; z < r; z++) comb[z] = comb[z - 1] + 1;
        }
        free(head);
        free(tail);
        free(next);
        }
    }
    if (all_pairs && !oom && npairs > 1) qsort(pairs, (size_t)npairs, sizeof(Pair), pair_cmp);
    Py_END_ALLOW_THREADS
#undef ADD_PAIR
    free(fp);
    if (oom) {
        free(pairs);
        free(best);
        return PyErr_NoMemory();
    }
    PyObject *out;
    if (all_pairs) {
        out = PyList_New(npairs);
        for (Py_ssize_t x = 0; out && x < npairs; x++) {
            PyObject *t = Py_BuildValue("(LL)", (long long)pairs[x].i, (long long)pairs[x].j);
            if (!t) { Py_CLEAR(out); break; }
            PyList_SET_ITEM(out, x, t);
        }
    } else {
        out = PyList_New(n);
        for (Py_ssize_t x = 0; out && x < n; x++) {
            PyObject *o = PyLong_FromLongLong((long long)best[x]);
            if (!o) { Py_CLEAR(out); break; }
            PyList_SET_ITEM(out, x, o);
        }
    }
    free(pairs);
    free(best);
    return out;
}

static PyMethodDef METHODS[] = {
    {"scan", py_scan, METH_VARARGS,
     "scan(text, mode, want, min_words, max_hits) -> (hits, total_hits, paragraphs, headings, "
     "delimiters)"},
    {"fingerprint", py_fingerprint, METH_VARARGS, "fingerprint(text) -> 64-bit simhash"},
    {"near", py_near, METH_VARARGS,
     "near(fps_bytes, max_distance, all_pairs) -> sorted pairs, or the nearest earlier index "
     "(-1 for none) per fingerprint"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_fastscan",
    "Compiled single-pass Layer-0 scanner and simhash index (see pipeline/contract/_scan.py).", -1,
    METHODS,
};

PyMODINIT_FUNC PyInit__fastscan(void) {
    static const char *specials = "\n{}[]()`\\%#\"'";
    for (int c = 0; c < 256; c++) {
        unsigned f = 0;
        if (Py_UNICODE_ISSPACE((Py_UCS4)c)) f |= F_SPACE;
        if (Py_UNICODE_ISALNUM((Py_UCS4)c) || c == '_') f |= F_W;
        if (c && strchr(specials, c)) f |= F_SPECIAL;
        if (c && strchr("TtXLlFA", c)) f |= F_TRIG;
        CLS[c] = (unsigned char)f;
    }
    static const char *rare[5] = {
        "\n?", "\n?`\\(){}[]", "\n?\\%(){}[]", "\n?#'\"\\(){}[]", "\n?\"\\(){}[]",
    };
    for (int m = 0; m < 5; m++)
        for (int c = 0; c < 256; c++)
            RTAB[m][c] = (unsigned char)(CLS[c] | ((c && strchr(rare[m], c)) ? F_RARE : 0));
    for (int c = 0; c < 256; c++) MUL[c] = (uint64_t)fold((Py_UCS4)c) * WORD_MUL;
    for (int p = 0; p < N_PATS; p++) {
        const char *t = PATS[p].text;
        if (!t[0] || !t[1] || t[0] == '?') continue;
        for (int v0 = 0; v0 < 2; v0++)
            for (int v1 = 0; v1 < 2; v1++) {
                int a = (unsigned char)t[0], b = (unsigned char)t[1];
                if (v0) { if (!PATS[p].ci) continue; a = (a >= 'a' && a <= 'z') ? a - 32 : (a >= 'A' && a <= 'Z') ? a + 32 : a; }
                if (v1) { if (!PATS[p].ci) continue; b = (b >= 'a' && b <= 'z') ? b - 32 : (b >= 'A' && b <= 'Z') ? b + 32 : b; }
                PFX[a] |= 1ULL << (b & 63);
                PFXHI[a] = (unsigned char)(b >> 6);
            }
    }
    for (int b = 0; b < 256; b++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++)
            if (b & (1 << j)) v |= (1ULL << (8 * j));
        SPREAD[b] = v;
    }
    return PyModule_Create(&MODULE);
}
