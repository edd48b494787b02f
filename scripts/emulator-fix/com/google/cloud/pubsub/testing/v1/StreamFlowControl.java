/*
 * Streaming-pull flow control for the Cloud Pub/Sub emulator (gcloud 528, pubsub-emulator 0.8.20).
 *
 * The real service delivers to a StreamingPull stream no more unsettled messages (and bytes) than
 * the client's first request asks for (max_outstanding_messages, max_outstanding_bytes). The
 * emulator ignores both and pushes a stream its whole backlog, up to 1,000 messages every 50 ms:
 * a subscriber limited to 50 messages or 20 KB is handed 5,000 messages it never asked for. Every
 * delivery counts towards a dead-letter policy, so a test of how a worker behaves under
 * preemption on the emulator measures the emulator, not the worker.
 *
 * This class carries each stream's limits from its request observer (which reads the first
 * request) to its pusher (which delivers), keyed by the subscription-name future the two share,
 * and counts what a stream holds: the ack ids it delivered that the backlog still has as
 * delivered (neither acked, nacked nor expired). The replaced pusher and observer
 * (FakePubsubServer$StreamingPullPusher, FakePubsubServer$StreamingPullRequestObserver) are the
 * emulator's own, rewritten from its bytecode with these calls added; like the real service, a
 * response may overshoot the byte limit by one response.
 */
package com.google.cloud.pubsub.testing.v1;

import java.lang.reflect.Field;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.WeakHashMap;

final class StreamFlowControl {
  private static final Map<Object, StreamFlowControl> BY_STREAM = new WeakHashMap<>();

  private final long maxMessages;
  private final long maxBytes;
  /** Ack id to message size, for what this stream delivered and the backlog still counts. */
  private final Map<String, Integer> held = new LinkedHashMap<>();
  private long heldBytes;

  private StreamFlowControl(long maxMessages, long maxBytes) {
    this.maxMessages = maxMessages;
    this.maxBytes = maxBytes;
  }

  /** Records the limits of the stream whose observer and pusher share `key`. */
  static synchronized void register(Object key, long maxMessages, long maxBytes) {
    BY_STREAM.put(key, new StreamFlowControl(maxMessages, maxBytes));
  }

  /** The stream's flow control; null when its first request set no limit. */
  static synchronized StreamFlowControl of(Object key) {
    StreamFlowControl f = BY_STREAM.get(key);
    return f == null || (f.maxMessages <= 0 && f.maxBytes <= 0) ? null : f;
  }

  /** How many messages the stream may be handed now (0: it holds its limit), at most `cap`. */
  synchronized int room(Backlog backlog, int cap) {
    Map<?, ?> delivered = deliveredOf(backlog);
    if (delivered == null) {
      return cap; // a backlog this class cannot read: no flow control, as before
    }
    settle(backlog, delivered);
    if (maxBytes > 0 && heldBytes >= maxBytes) {
      return 0;
    }
    if (maxMessages > 0) {
      return (int) Math.max(0, Math.min(cap, maxMessages - held.size()));
    }
    return cap;
  }

  /** Counts a delivered message. */
  synchronized void delivered(String ackId, int bytes) {
    held.put(ackId, bytes);
    heldBytes += bytes;
  }

  /** Forgets the messages the backlog no longer counts as delivered. */
  private void settle(Backlog backlog, Map<?, ?> delivered) {
    synchronized (backlog) {
      for (Iterator<Map.Entry<String, Integer>> it = held.entrySet().iterator(); it.hasNext(); ) {
        Map.Entry<String, Integer> e = it.next();
        if (!delivered.containsKey(e.getKey())) {
          heldBytes -= e.getValue();
          it.remove();
        }
      }
    }
  }

  private static Map<?, ?> deliveredOf(Backlog backlog) {
    for (Class<?> c = backlog.getClass(); c != null; c = c.getSuperclass()) {
      try {
        Field f = c.getDeclaredField("delivered");
        f.setAccessible(true);
        return (Map<?, ?>) f.get(backlog);
      } catch (NoSuchFieldException e) {
        // look in the superclass
      } catch (ReflectiveOperationException e) {
        return null;
      }
    }
    return null;
  }
}
