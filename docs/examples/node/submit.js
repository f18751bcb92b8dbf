// submit.js — submit one worker output to critique-pipeline and print its verdict, with nothing
// but Node's standard library (18+):   node submit.js submission.json [config.json]
//
// Environment:
//   REDIS_URL  redis://[user:password@]host[:port][/db], the Redis the workers' REDIS_URL names
//              (default redis://127.0.0.1:6379/0, as on the Python side); the user is the
//              critique-manager ACL user. Plain redis:// only: no TLS, no Sentinel.
//   CRITIQUE_ENTRY_SECRET  the managers' key, the key alone (not name=key); unset: unsigned.
//              Before it sends anything it reads the fleet's posture (docs/entry.md) and stops
//              there, exit 2, when the workers would refuse the message unsigned or so signed.
// Prints the verdict as one JSON line on stdout, {run_id, iteration, worker_id, status,
// stop_reason, best_score, checked}, and while it waits a progress line on stderr every 10 s.
// Exit status: 0 a verdict (whatever it says: read its status), 1 the worker refused the
// message or no verdict came within WAIT_S, 2 nothing was sent: bad arguments, files or
// REDIS_URL, or a key the workers would refuse, 3 Redis could not be reached or refused a command.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const net = require('net');

const DEFAULT_REDIS_URL = 'redis://127.0.0.1:6379/0';
const WAIT_S = 300; // how long to wait for a verdict (an LLM critic with repairs takes minutes)

// The bytes a signature covers: keys sorted, no whitespace, strings as JSON writes them, UTF-8.
function canonical(value) {
  if (Array.isArray(value)) return '[' + value.map(canonical).join(',') + ']';
  if (value !== null && typeof value === 'object') {
    const keys = Object.keys(value).sort();
    return '{' + keys.map((k) => JSON.stringify(k) + ':' + canonical(value[k])).join(',') + '}';
  }
  return JSON.stringify(value);
}

// "sig": HMAC-SHA256 (hex) of the canonical JSON of every other field.
function signEntry(body, key) {
  const { sig, ...rest } = body; // eslint-disable-line no-unused-vars
  const mac = crypto.createHmac('sha256', key).update(canonical(rest), 'utf8').digest('hex');
  return { ...rest, sig: 'hmac-sha256:' + mac };
}

function entryMessage(submission, taskId, config, key) {
  const body = {
    v: 1, submission, config: config || {}, task_name: 'critique.submit', task_id: taskId,
  };
  return key ? signEntry(body, key) : body;
}

// Celery protocol 2, as kombu's Redis transport keeps a message in the queue's list.
function celeryMessage(taskId, entry) {
  const payload = JSON.stringify([[entry], {}, { callbacks: null, errbacks: null, chain: null }]);
  return JSON.stringify({
    body: Buffer.from(payload, 'utf8').toString('base64'),
    'content-encoding': 'utf-8',
    'content-type': 'application/json',
    headers: {
      lang: 'js', task: 'critique.submit', id: taskId, root_id: taskId, parent_id: null,
      group: null, argsrepr: '(entry,)', kwargsrepr: '{}', origin: 'node', retries: 0,
      eta: null, expires: null, timelimit: [null, null], shadow: null,
    },
    properties: {
      correlation_id: taskId, reply_to: '', delivery_mode: 2, priority: 0,
      delivery_info: { exchange: '', routing_key: 'critique.cpu' },
      body_encoding: 'base64', delivery_tag: crypto.randomUUID(),
    },
  });
}

class UsageError extends Error {} // exit 2: nothing was sent

// A key's id: a short name that does not reveal it (the fleet's posture lists keys by id).
function keyId(key) {
  return crypto.createHmac('sha256', key).update('critique-key-id').digest('hex').slice(0, 8);
}

// Why the live workers would refuse an entry message signed with `key` (unset: unsigned), from
// the fields of the posture hash (HGETALL: name, record, name, record, ...); null: they would not.
function postureRefusal(fields, key, now) {
  const live = [];
  for (let i = 1; i < fields.length; i += 2) {
    let p = null;
    try { p = JSON.parse(fields[i]); } catch { /* not a record: ignore it */ }
    if (p && now - p.seen <= (p.fresh_s || 60)) live.push(p);
  }
  const signers = live.filter((p) => p.entry_signed);
  if (!signers.length) return null; // no worker said (an older fleet), or none needs a key
  const keys = signers.flatMap((p) => p.entry_keys || []);
  const names = [...new Set(keys.map((k) => k.name))].sort().join(', ');
  const some = `${signers.length} of the ${live.length} live worker(s)`;
  if (!key) {
    return `the workers require signed entry messages (${some}; keys named ${names}) and `
      + 'CRITIQUE_ENTRY_SECRET is not set: nothing was sent; set it to your managers\' key '
      + '(in a one-secret fleet, the workers\' CRITIQUE_SECRET)';
  }
  const mine = keyId(key);
  if (signers.every((p) => (p.entry_keys || []).some((k) => k.key_id === mine))) return null;
  const ids = [...new Set(keys.map((k) => k.key_id))].sort().join(', ');
  return `CRITIQUE_ENTRY_SECRET is not a key the workers accept (it signs as key id ${mine}; `
    + `${some} accept ${ids}, named ${names}): nothing was sent; ask the operator for your key`;
}

// A URL for messages: the password of user:password@ shown as ***.
function redact(url) {
  const at = url.lastIndexOf('@');
  const colon = url.indexOf(':', url.indexOf('://') + 3);
  return at < 0 || colon < 0 || colon > at ? url : url.slice(0, colon + 1) + '***' + url.slice(at);
}

// REDIS_URL -> {host, port, db, user, password, shown}, or a UsageError naming what is wrong.
function redisTarget(env) {
  if (!env.REDIS_URL && (env.REDIS_HOST || env.REDIS_PORT)) {
    throw new UsageError('REDIS_HOST and REDIS_PORT are not read: set REDIS_URL instead, '
      + 'e.g. REDIS_URL=redis://127.0.0.1:6379/0');
  }
  const value = env.REDIS_URL || DEFAULT_REDIS_URL;
  const bad = (why) => new UsageError(`REDIS_URL='${redact(value)}' ${why}; `
    + 'set e.g. REDIS_URL=redis://127.0.0.1:6379/0 (this example speaks redis:// only)');
  if (!value.includes('://')) throw bad('has no scheme');
  let u;
  try {
    u = new URL(value);
  } catch {
    throw bad('is not a URL (is its port a number up to 65535?)');
  }
  if (u.protocol !== 'redis:') throw bad(`has the scheme '${u.protocol.slice(0, 20)}'`);
  if (u.search || u.hash) throw bad('has options (?… or #…) this example does not read');
  const db = u.pathname.replace(/^\/|\/$/g, '') || '0';
  if (!/^\d+$/.test(db)) throw bad(`has a path '${db}' where the database number goes (/0 … /15)`);
  const host = u.hostname || '127.0.0.1';
  const port = Number(u.port || 6379);
  const user = decodeURIComponent(u.username);
  return {
    host: host.replace(/^\[|\]$/g, ''), // [::1] -> ::1
    port, db, user,
    password: decodeURIComponent(u.password),
    shown: `redis://${user ? user + '@' : ''}${host}:${port}/${db}`, // for messages
  };
}

// A minimal Redis client (RESP2): enough for AUTH, SELECT, HGETALL, LPUSH and GET.
// One reply from buf at `at`: {value, used} or {error, used}; null while it is incomplete.
function parse(buf, at = 0) {
  const eol = buf.indexOf('\r\n', at);
  if (eol < 0) return null;
  const type = String.fromCharCode(buf[at]);
  const line = buf.subarray(at + 1, eol).toString();
  const used = eol + 2 - at;
  if (type === '+') return { value: line, used };
  if (type === ':') return { value: Number(line), used };
  if (type === '-') return { error: line, used };
  const n = Number(line);
  if (n < 0) return { value: null, used }; // a nil bulk string or array
  if (type === '*') { // an array of n replies
    const value = [];
    let end = eol + 2;
    for (let i = 0; i < n; i++) {
      const r = parse(buf, end);
      if (!r) return null;
      value.push(r.value);
      end += r.used;
    }
    return { value, used: end - at };
  }
  if (buf.length < eol + 4 + n) return null; // '$': a bulk string of n bytes
  return { value: buf.subarray(eol + 2, eol + 2 + n).toString('utf8'), used: used + n + 2 };
}

class RedisError extends Error {} // exit 3

function connect(target) {
  const sock = net.createConnection({ host: target.host, port: target.port });
  const waiting = [];
  let buf = Buffer.alloc(0);
  let broken = null;
  const fail = (why) => {
    broken = broken || new RedisError(`Redis at ${target.shown}: ${why}`);
    while (waiting.length) waiting.shift().reject(broken);
  };
  sock.on('error', (e) => fail(`${e.code || e.message} (is it running? is REDIS_URL right?)`));
  sock.on('close', () => fail('connection closed'));
  sock.on('data', (data) => {
    buf = Buffer.concat([buf, data]);
    for (let r; waiting.length && (r = parse(buf)); ) {
      buf = buf.subarray(r.used);
      const w = waiting.shift();
      if (r.error) w.reject(Object.assign(new RedisError(`Redis at ${target.shown}: ${r.error}`),
        { reply: r.error }));
      else w.resolve(r.value);
    }
  });
  const send = (...args) => new Promise((resolve, reject) => {
    if (broken) return reject(broken);
    waiting.push({ resolve, reject });
    sock.write(`*${args.length}\r\n` +
      args.map((a) => `$${Buffer.byteLength(String(a))}\r\n${a}\r\n`).join(''));
  });
  return { send, close: () => { broken = broken || new RedisError('closed'); sock.end(); } };
}

function readJson(path, what) {
  let text;
  try {
    text = fs.readFileSync(path, 'utf8');
  } catch (e) {
    throw new UsageError(`cannot read the ${what} ${path}: ${e.code || e.message}`);
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new UsageError(`the ${what} ${path} is not JSON: ${e.message}`);
  }
}

async function main(argv, env) {
  if (argv.length < 1 || argv.length > 2) {
    throw new UsageError('usage: node submit.js submission.json [config.json]');
  }
  const submission = readJson(argv[0], 'submission');
  const config = argv[1] ? readJson(argv[1], 'configuration') : {};
  const target = redisTarget(env);
  const taskId = crypto.randomUUID(); // the verdict lands under this id
  const entry = entryMessage(submission, taskId, config, env.CRITIQUE_ENTRY_SECRET);
  const r = connect(target);
  try {
    if (target.password) {
      await r.send('AUTH', ...(target.user ? [target.user] : []), target.password);
    }
    await r.send('SELECT', target.db);
    const posture = `${env.CRITIQUE_KEY_PREFIX || 'critique'}:fleet:posture`;
    const fields = await r.send('HGETALL', posture).catch((e) => {
      if (/^NOPERM/.test(e.reply)) return []; // an older ACL: go on, the worker still checks
      throw e;
    });
    const refusal = postureRefusal(fields, env.CRITIQUE_ENTRY_SECRET, Date.now() / 1000);
    if (refusal) throw new UsageError(refusal);
    await r.send('LPUSH', 'critique.cpu', celeryMessage(taskId, entry));
    const started = Date.now();
    for (let said = 0; Date.now() - started < WAIT_S * 1000; ) { // poll the result backend
      const raw = await r.send('GET', `celery-task-meta-${taskId}`);
      const meta = raw && JSON.parse(raw);
      if (meta && meta.status === 'SUCCESS') {
        console.log(JSON.stringify(meta.result)); // {run_id, worker_id, status, best_score, ...}
        return 0;
      }
      if (meta && meta.status === 'FAILURE') {
        console.error(`refused: ${meta.result.exc_type}: ${meta.result.exc_message[0]}`);
        return 1;
      }
      const waited = Math.floor((Date.now() - started) / 10000) * 10;
      if (waited > said) {
        said = waited;
        console.error(`no verdict yet after ${waited} s (task ${taskId} on ${target.shown}; `
          + 'is a worker consuming critique.cpu on that Redis and database?)');
      }
      await new Promise((done) => setTimeout(done, 100));
    }
    console.error(`no verdict after ${WAIT_S} s: the message stays queued; its verdict will `
      + `land under celery-task-meta-${taskId} on ${target.shown}`);
    return 1;
  } finally {
    r.close();
  }
}

module.exports = {
  canonical, signEntry, entryMessage, celeryMessage, redisTarget, keyId, postureRefusal,
};
if (require.main === module) {
  main(process.argv.slice(2), process.env).then((code) => { process.exitCode = code; }, (e) => {
    console.error(e.message);
    process.exitCode = e instanceof UsageError ? 2 : e instanceof RedisError ? 3 : 1;
  });
}
