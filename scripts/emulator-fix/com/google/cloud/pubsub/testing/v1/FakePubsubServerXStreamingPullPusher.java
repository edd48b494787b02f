/*
 * The emulator's StreamingPull pusher (gcloud 528, pubsub-emulator 0.8.20), rewritten from its
 * bytecode with flow control added (see StreamFlowControl.java): each turn it pulls no more than
 * the stream may hold. Everything else is as in the original: wait for the first request, then
 * every 50 ms push what the backlog has, until the stream ends. The original is an inner class;
 * this top-level class of the same binary name takes the server as its first constructor
 * argument, which is what the inner class's constructor took, and reaches the server's synthetic
 * accessors by reflection.
 */
package com.google.cloud.pubsub.testing.v1;

import com.google.pubsub.v1.ReceivedMessage;
import com.google.pubsub.v1.StreamingPullResponse;
import io.grpc.Status;
import io.grpc.StatusException;
import io.grpc.stub.StreamObserver;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.time.Duration;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.Future;
import java.util.concurrent.atomic.AtomicInteger;

final class FakePubsubServerXStreamingPullPusher implements Runnable {
  private static final int MAX_PER_RESPONSE = 1000;

  private final FakePubsubServer server;
  private final long streamId;
  private final StreamObserver<StreamingPullResponse> responseObserver;
  private final Future<String> subscriptionNameFuture;
  private final Future<Void> terminationFuture;
  private final AtomicInteger deadlineSecs;
  private final RpcDeadline streamDeadline;
  private final AckConfirmationsAggregator ackConfirmationsAggregator;
  private String subscriptionName;
  private String subscriptionId;

  FakePubsubServerXStreamingPullPusher(
      FakePubsubServer server,
      long streamId,
      StreamObserver<StreamingPullResponse> responseObserver,
      Future<String> subscriptionNameFuture,
      Future<Void> terminationFuture,
      AtomicInteger deadlineSecs,
      RpcDeadline streamDeadline,
      AckConfirmationsAggregator ackConfirmationsAggregator) {
    this.server = server;
    this.streamId = streamId;
    this.responseObserver = responseObserver;
    this.subscriptionNameFuture = subscriptionNameFuture;
    this.terminationFuture = terminationFuture;
    this.deadlineSecs = deadlineSecs;
    this.streamDeadline = streamDeadline;
    this.ackConfirmationsAggregator = ackConfirmationsAggregator;
  }

  /** Calls the server's synthetic static accessor `name` (javac hides synthetic members). */
  static Object access(String name, Object... args) throws StatusException {
    for (Method m : FakePubsubServer.class.getDeclaredMethods()) {
      if (m.getName().equals(name) && m.getParameterCount() == args.length) {
        try {
          m.setAccessible(true);
          return m.invoke(null, args);
        } catch (InvocationTargetException e) {
          if (e.getCause() instanceof StatusException) {
            throw (StatusException) e.getCause();
          }
          throw new IllegalStateException(e.getCause());
        } catch (IllegalAccessException e) {
          throw new IllegalStateException(e);
        }
      }
    }
    throw new IllegalStateException("emulator accessor " + name + " not found");
  }

  private void checkReset() throws StatusException {
    if ((Boolean) access("access$100", server)) {
      throw Status.ABORTED.withDescription("emulator is being reset").asException();
    }
  }

  private void checkSubscription(FakePubsubServer.SubscriptionData subscription)
      throws StatusException {
    if (subscription == null) {
      throw Status.NOT_FOUND
          .withDescription(
              String.format("Subscription does not exist (resource=%s)", this.subscriptionId))
          .asException();
    }
    if (!subscription.getPushConfig().getPushEndpoint().isEmpty()) {
      throw Status.FAILED_PRECONDITION
          .withDescription(
              String.format(
                  "Subscription is a push subscription: (resource=%s)", this.subscriptionName))
          .asException();
    }
    if (subscription.getDetached()) {
      throw Status.FAILED_PRECONDITION.withDescription("Subscription is detached.").asException();
    }
    if (this.streamDeadline.isExpired()) {
      throw Status.DEADLINE_EXCEEDED.asException();
    }
  }

  private synchronized StreamingPullResponse.Builder responseBuilder() {
    StreamingPullResponse.Builder b = StreamingPullResponse.newBuilder();
    StreamingPullResponse.AcknowledgeConfirmation.Builder acks =
        b.getAcknowledgeConfirmationBuilder();
    AckConfirmations c = this.ackConfirmationsAggregator.getAckConfirmationsForAcks();
    acks.addAllAckIds(c.getSuccessfullyProcessedAckIds());
    acks.addAllInvalidAckIds(c.getInvalidAckIds());
    acks.addAllUnorderedAckIds(c.getUnorderedAckIds());
    StreamingPullResponse.ModifyAckDeadlineConfirmation.Builder modAcks =
        b.getModifyAckDeadlineConfirmationBuilder();
    c = this.ackConfirmationsAggregator.getAckConfirmationsForModAcks();
    modAcks.addAllAckIds(c.getSuccessfullyProcessedAckIds());
    modAcks.addAllInvalidAckIds(c.getInvalidAckIds());
    this.ackConfirmationsAggregator.clearAckConfirmationsForAcknowledgements();
    this.ackConfirmationsAggregator.clearAckConfirmationsForModAcknowledgements();
    return b;
  }

  /** What the backlog hands this stream now: at most what its flow control leaves room for. */
  private List<ReceivedMessage> pull(Backlog backlog) {
    StreamFlowControl flow = StreamFlowControl.of(this.subscriptionNameFuture);
    int room = flow == null ? MAX_PER_RESPONSE : flow.room(backlog, MAX_PER_RESPONSE);
    if (room <= 0) {
      return Collections.emptyList();
    }
    List<ReceivedMessage> out =
        backlog.streamingPull(this.streamId, room, Duration.ofSeconds(this.deadlineSecs.get()));
    if (flow != null) {
      for (ReceivedMessage m : out) {
        flow.delivered(m.getAckId(), m.getMessage().getSerializedSize());
      }
    }
    return out;
  }

  @Override
  public void run() {
    try {
      access("access$000", server);
    } catch (StatusException e) {
      throw new IllegalStateException(e);
    }
    try {
      while (!this.subscriptionNameFuture.isDone()) {
        checkReset();
        Thread.sleep(50L);
      }
      this.subscriptionName = this.subscriptionNameFuture.get();
      if (this.subscriptionName == null) {
        this.responseObserver.onCompleted();
        return;
      }
      // The original parses it with a private helper; the name was validated by the observer.
      this.subscriptionId = this.subscriptionName.substring(this.subscriptionName.lastIndexOf('/') + 1);
      while (!this.terminationFuture.isDone()) {
        checkReset();
        FakePubsubServer.SubscriptionData subscription =
            server.getSubscription(this.subscriptionName);
        checkSubscription(subscription);
        List<ReceivedMessage> newMessages = pull(subscription.getBacklog());
        if (!newMessages.isEmpty()) {
          StreamingPullResponse.SubscriptionProperties.Builder props =
              StreamingPullResponse.SubscriptionProperties.newBuilder();
          props.setMessageOrderingEnabled(subscription.getConfig().getEnableMessageOrdering());
          props.setExactlyOnceDeliveryEnabled(
              subscription.getConfig().getEnableExactlyOnceDelivery());
          this.responseObserver.onNext(
              responseBuilder()
                  .setSubscriptionProperties(props.build())
                  .addAllReceivedMessages(newMessages)
                  .build());
        }
        Thread.sleep(50L);
      }
      this.terminationFuture.get();
    } catch (InterruptedException e) {
      this.responseObserver.onError(Status.CANCELLED.withCause(e).asException());
      return;
    } catch (Throwable t) {
      this.responseObserver.onError(Status.fromThrowable(t).asException());
      return;
    } finally {
      try {
        access("access$200", server);
      } catch (StatusException e) {
        // not thrown by this accessor
      }
      FakePubsubServer.SubscriptionData subscription =
          this.subscriptionName == null ? null : server.getSubscription(this.subscriptionName);
      if (subscription != null) {
        subscription.getBacklog().onStreamingPullCompleted(this.streamId);
      }
    }
    this.responseObserver.onCompleted();
  }
}
